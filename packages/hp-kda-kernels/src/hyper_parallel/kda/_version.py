__version__ = "0.3.5.dev3"
