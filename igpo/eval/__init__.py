"""Evaluation of a checkpoint (avg@K / pass@K) and the dataset schema."""
