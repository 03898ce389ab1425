"""The fake `libnvidia-ml.so.1`: building it (`build`) and driving it from outside (`control`)."""
