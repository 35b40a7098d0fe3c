"""Task pods' fsspec/s3fs readers use the object store flytekit is configured for."""

from fuseforge_flyte.object_store import share_flyte_s3_settings


def test_flytekit_settings_reach_botocore():
    environ = {"FLYTE_AWS_ENDPOINT": "http://store:9000", "FLYTE_AWS_ACCESS_KEY_ID": "id",
               "FLYTE_AWS_SECRET_ACCESS_KEY": "secret"}
    share_flyte_s3_settings(environ)
    assert environ["AWS_ENDPOINT_URL_S3"] == "http://store:9000"
    assert (environ["AWS_ACCESS_KEY_ID"], environ["AWS_SECRET_ACCESS_KEY"]) == ("id", "secret")


def test_botocores_own_settings_win_and_nothing_is_invented():
    environ = {"FLYTE_AWS_ENDPOINT": "http://store:9000", "AWS_ENDPOINT_URL_S3": "http://other:9000",
               "AWS_ACCESS_KEY_ID": "mine"}
    share_flyte_s3_settings(environ)
    assert environ == {"FLYTE_AWS_ENDPOINT": "http://store:9000", "AWS_ENDPOINT_URL_S3": "http://other:9000",
                       "AWS_ACCESS_KEY_ID": "mine"}
    empty = {}
    share_flyte_s3_settings(empty)
    assert empty == {}


def test_the_same_bytes_uploaded_again_keep_their_fingerprint():
    """`pyflyte run --remote` uploads a local dataset on every run: a new write time, the same ETag."""
    from fuseforge_flyte.data.fingerprint import object_identity

    first = {"ETag": '"abc"', "size": 10, "LastModified": "2026-12-05 10:00:00", "type": "file"}
    again = dict(first, LastModified="2026-12-05 10:30:00")
    assert object_identity(first) == object_identity(again) == {"etag": '"abc"', "size": "10"}
    assert object_identity(dict(first, ETag='"def"')) != object_identity(first)
    # A store that gives no content hash: the write time is all there is.
    plain = {"size": 10, "mtime": 1.0}
    assert object_identity(plain) != object_identity(dict(plain, mtime=2.0))
