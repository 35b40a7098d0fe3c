"""The training image: its ImageSpec from platform.toml's [image], the builders that build and push it, its hash lock.

Nothing is imported here, so that reading the lock (images/lock.py) does not load flytekit; importing the
ImageSpec module registers its builders with flytekit, as the tasks need them.
"""
