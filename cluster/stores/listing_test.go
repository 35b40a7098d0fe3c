package main

import (
	"strings"
	"testing"

	"github.com/johannesboyne/gofakes3"
	"github.com/johannesboyne/gofakes3/backend/s3afero"
	"github.com/spf13/afero"
)

func TestListingUnderAPrefixThatNamesNoFolderIsEmpty(t *testing.T) {
	root := afero.NewBasePathFs(afero.NewOsFs(), t.TempDir())
	inner, err := s3afero.MultiBucket(root)
	if err != nil {
		t.Fatal(err)
	}
	backend := prefixListing{inner}
	if err := backend.CreateBucket("bucket"); err != nil {
		t.Fatal(err)
	}
	body := "payload"
	if _, err := backend.PutObject("bucket", "code/X47B======/fast.tar.gz", nil, strings.NewReader(body), int64(len(body)), nil); err != nil {
		t.Fatal(err)
	}
	for _, prefix := range []string{"code/X47B======/fast.tar.gz/", "missing/", "code/X47B======/fast.tar.gz/deeper/"} {
		p := gofakes3.NewFolderPrefix(prefix)
		list, err := backend.ListBucket("bucket", &p, gofakes3.ListBucketPage{})
		if err != nil {
			t.Errorf("%s: %v", prefix, err)
		} else if len(list.Contents) != 0 || len(list.CommonPrefixes) != 0 {
			t.Errorf("%s: want an empty list, got %+v", prefix, list)
		}
	}
	p := gofakes3.NewFolderPrefix("code/")
	list, err := backend.ListBucket("bucket", &p, gofakes3.ListBucketPage{})
	if err != nil || len(list.CommonPrefixes) != 1 {
		t.Errorf("a real folder lists its entries: %+v, %v", list, err)
	}
	if _, err := backend.ListBucket("nope", &p, gofakes3.ListBucketPage{}); !gofakes3.HasErrorCode(err, gofakes3.ErrNoSuchBucket) {
		t.Errorf("a missing bucket is still NoSuchBucket: %v", err)
	}
}
