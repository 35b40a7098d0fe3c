"""The training image: its ImageSpec from platform.toml's [image], the builders that build and push it, its hash lock.

Here: what all of its modules share. Nothing is imported, so that reading the lock (images/lock.py) does not load
flytekit; importing the ImageSpec module registers its builders with flytekit, as the tasks need them.
"""

# uid/gid of the image's user "flytekit", which the Helm chart's pods run as (platform.podSecurityContext):
# Kubernetes can only check runAsNonRoot against a numeric uid, and /root (where Flyte runs tasks) is its.
# images/Dockerfile creates the user with it; the ImageSpec build (flytekit creates the user) checks it.
IMAGE_UID = 1001


class ImageBuildError(RuntimeError):
    """The image cannot be built on this machine (no Docker, no source checkout)."""
