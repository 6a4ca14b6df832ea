"""Thin glue between hf_deltamatch and other libraries."""
