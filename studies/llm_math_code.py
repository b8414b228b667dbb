"""Entry point of the LLM study; the recipe is ``studies/llm/run.py`` (``--help`` for options)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file: find `studies`
from studies.llm.run import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
