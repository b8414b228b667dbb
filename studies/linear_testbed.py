"""Entry point kept for the README's command; the study is the package ``studies.testbed``."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from studies.testbed.run import main  # noqa: E402

if __name__ == "__main__":
    main()
