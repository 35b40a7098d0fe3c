// Command stores serves the local cluster's object store and image registry on loopback:
//
//	stores s3 --address 127.0.0.1:19000 --root DIR --bucket NAME --access-key-file F --secret-key-file F
//	stores registry --address 127.0.0.1:15000 --root DIR
//
// The object store is gofakes3 over a directory (S3's API, path-style); the registry is
// go-containerregistry's OCI distribution registry with blobs on disk.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log"
	"net/http"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/google/go-containerregistry/pkg/registry"
	"github.com/johannesboyne/gofakes3"
	"github.com/johannesboyne/gofakes3/backend/s3afero"
	"github.com/spf13/afero"
)

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: stores s3|registry [flags]")
		os.Exit(2)
	}
	var err error
	switch os.Args[1] {
	case "s3":
		err = serveS3(os.Args[2:])
	case "registry":
		err = serveRegistry(os.Args[2:])
	default:
		err = fmt.Errorf("unknown store %q (s3 or registry)", os.Args[1])
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "stores:", err)
		os.Exit(1)
	}
}

func serveS3(args []string) error {
	flags := flag.NewFlagSet("s3", flag.ExitOnError)
	address := flags.String("address", "127.0.0.1:19000", "listen address (loopback)")
	root := flags.String("root", "", "directory holding the buckets")
	bucket := flags.String("bucket", "", "bucket created at start")
	accessKeyFile := flags.String("access-key-file", "", "file holding the one accepted access key id")
	secretKeyFile := flags.String("secret-key-file", "", "file holding its secret key (clients sign with it)")
	_ = flags.Parse(args)
	if *root == "" || *accessKeyFile == "" || *secretKeyFile == "" {
		return errors.New("s3: --root, --access-key-file and --secret-key-file are required")
	}
	accessKey, err := os.ReadFile(*accessKeyFile)
	if err != nil {
		return err
	}
	secretKey, err := os.ReadFile(*secretKeyFile)
	if err != nil {
		return err
	}
	if err := os.MkdirAll(*root, 0o700); err != nil {
		return err
	}
	backend, err := s3afero.MultiBucket(afero.NewBasePathFs(afero.NewOsFs(), *root))
	if err != nil {
		return err
	}
	if *bucket != "" {
		if exists, _ := backend.BucketExists(*bucket); !exists {
			if err := backend.CreateBucket(*bucket); err != nil {
				return err
			}
		}
	}
	faker := gofakes3.New(prefixListing{backend}, gofakes3.WithAutoBucket(false), gofakes3.WithTimeSkewLimit(15*time.Minute))
	creds := Credentials{strings.TrimSpace(string(accessKey)): strings.TrimSpace(string(secretKey))}
	handler := requireSignature(creds, faker.Server())
	return serve(*address, handler)
}

// requireSignature refuses requests that are not signed (SigV4 header or presigned URL) with the
// configured key pair, as S3 does; gofakes3 itself checks no signature.
func requireSignature(creds Credentials, next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if err := verify(r, creds, time.Now().UTC(), 15*time.Minute); err != nil {
			code, message := "SignatureDoesNotMatch",
				"The request signature we calculated does not match the signature you provided. Check your key and signing method."
			var auth *authError
			if errors.As(err, &auth) {
				code, message = auth.code, auth.message
			}
			log.Printf("refused %s %s: %s", r.Method, r.URL.Path, code)
			w.Header().Set("Content-Type", "application/xml")
			w.WriteHeader(http.StatusForbidden)
			fmt.Fprintf(w, `<?xml version="1.0" encoding="UTF-8"?><Error><Code>%s</Code><Message>%s</Message></Error>`, code, message)
			return
		}
		next.ServeHTTP(w, r)
	})
}

func serveRegistry(args []string) error {
	flags := flag.NewFlagSet("registry", flag.ExitOnError)
	address := flags.String("address", "127.0.0.1:15000", "listen address (loopback)")
	root := flags.String("root", "", "directory for blobs")
	_ = flags.Parse(args)
	if *root == "" {
		return errors.New("registry: --root is required")
	}
	if err := os.MkdirAll(*root, 0o700); err != nil {
		return err
	}
	return serve(*address, registry.New(registry.WithBlobHandler(registry.NewDiskBlobHandler(*root))))
}

// serve runs handler on address until SIGTERM/SIGINT, then shuts down gracefully.
func serve(address string, handler http.Handler) error {
	server := &http.Server{Addr: address, Handler: handler, ReadHeaderTimeout: 30 * time.Second}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	errs := make(chan error, 1)
	go func() { errs <- server.ListenAndServe() }()
	log.Printf("serving on http://%s", address)
	select {
	case err := <-errs:
		return err
	case <-ctx.Done():
		shutdown, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		return server.Shutdown(shutdown)
	}
}
