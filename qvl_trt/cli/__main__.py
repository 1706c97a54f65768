"""`python -m qvl_trt.cli`: the python entry the gateway process and tests run."""

from . import main

main()
