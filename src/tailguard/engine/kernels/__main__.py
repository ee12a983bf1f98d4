import sys

from tailguard.engine.kernels import main

sys.exit(main())
