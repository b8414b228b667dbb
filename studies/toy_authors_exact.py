"""Entry point kept for the README's command: the recipe is studies/toy/authors_exact.py."""

from toy.authors_exact import main  # noqa: E402  (studies/ is on sys.path when this file runs)

raise SystemExit(main())
