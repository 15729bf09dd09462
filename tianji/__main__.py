import sys

from tianji.cli import main

sys.exit(main())
