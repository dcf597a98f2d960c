"""Dataset preparation scripts. A package so that prepare.py scripts can share helpers
(`from data.shakespeare_text import ...`) with the repo root on sys.path."""
