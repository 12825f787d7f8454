import sys

from engine.bench import main

sys.exit(main(sys.argv[1:]))
