"""``graphstep bench``: the A/B performance harness (see harness.py for the method)."""
