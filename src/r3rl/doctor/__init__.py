"""``python doctor.py``: proves R3 holds on the user's own stack before a long run (``recipes/doctor.py``)."""
