"""linattn: linear attention, every mixer three ways that agree, with the experiments that test it."""

__version__ = "0.1.0"
