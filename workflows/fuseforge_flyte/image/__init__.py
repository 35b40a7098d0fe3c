"""The training image: its ImageSpec from platform.toml's [image], the builders that build and push it, its hash lock.

spec.py makes the ImageSpec (importing it registers its builders with flytekit, as the tasks need them);
docker.py is its builder "fuseforge" (Docker, buildah where no daemon answers, the registry check at
registration); buildah.py the daemonless builder "fuseforge-buildah"; base.py a base image made with
debootstrap; requirements.py what the image installs and whether the lock covers it; lock.py reads the lock
(images/requirements.txt); sources.py stages the source checkout; registry.py asks a registry what it holds;
registration.py tells whether this process registers tasks with a cluster.

Here: what all of them share. Nothing is imported, so that reading the lock (images/lock.py) does not load flytekit.
"""

# uid/gid of the image's user "flytekit", which the Helm chart's pods run as (platform.podSecurityContext):
# Kubernetes can only check runAsNonRoot against a numeric uid, and /root (where Flyte runs tasks) is its.
# images/Dockerfile creates the user with it; the ImageSpec build (flytekit creates the user) checks it.
IMAGE_UID = 1001


class ImageBuildError(RuntimeError):
    """The image cannot be built on this machine (no Docker, no source checkout)."""
