"""Several ranks: the process group, the split layout and the collectives, and the bytes they move."""
