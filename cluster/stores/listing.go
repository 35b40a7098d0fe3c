package main

import (
	"errors"
	"os"
	"syscall"

	"github.com/johannesboyne/gofakes3"
	"github.com/johannesboyne/gofakes3/backend/s3afero"
)

// prefixListing answers a listing under a prefix that names no folder the way S3 does: with an empty list.
// s3afero instead says the bucket does not exist (a prefix whose folder is missing) or fails with an
// internal error (a prefix below an object, "key/": how s3fs, and so flytekit in every task pod, asks
// whether a key is a directory before downloading it).
type prefixListing struct {
	*s3afero.MultiBucketBackend
}

func (b prefixListing) ListBucket(bucket string, prefix *gofakes3.Prefix, page gofakes3.ListBucketPage) (*gofakes3.ObjectList, error) {
	list, err := b.MultiBucketBackend.ListBucket(bucket, prefix, page)
	if err == nil {
		return list, nil
	}
	missingFolder := gofakes3.HasErrorCode(err, gofakes3.ErrNoSuchBucket) || os.IsNotExist(err) ||
		errors.Is(err, syscall.ENOTDIR)
	if !missingFolder {
		return nil, err
	}
	if exists, existsErr := b.BucketExists(bucket); existsErr != nil || !exists {
		return nil, err
	}
	return gofakes3.NewObjectList(), nil
}
