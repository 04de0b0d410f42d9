"""The parts of `bench/bench.py`, one module each, and what they share (`common`, `report`)."""
