import sys

from ankusa_shm.cli import main

sys.exit(main())
