"""Entry point kept for the README's command: the toy study's recipe is studies/toy/run.py."""

from toy.run import main  # noqa: E402  (studies/ is on sys.path when this file runs)

raise SystemExit(main())
