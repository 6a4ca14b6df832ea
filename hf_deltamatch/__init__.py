"""hf_deltamatch: FP8 attention that trains (Delta-Matching)."""
