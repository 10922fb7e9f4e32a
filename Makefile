# The two commands of the README's quick start, and the ones behind them.
.PHONY: install test demo bench-capacity

install:
	scripts/install.sh

test:
	scripts/test.sh

demo: install
	.venv/bin/proxima demo

bench-capacity: install
	.venv/bin/python scripts/bench_capacity.py
