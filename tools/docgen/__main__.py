"""``python -m tools.docgen``: the same as ``python -m tools.docgen``."""
from tools.docgen.docgen import main

if __name__ == "__main__":
    raise SystemExit(main())
