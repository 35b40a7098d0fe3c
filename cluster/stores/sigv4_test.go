package main

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	v4 "github.com/aws/aws-sdk-go-v2/aws/signer/v4"
)

var testCreds = Credentials{"AKIDLOCAL": "s3cr3t"}

// store stands for the object store: it keeps the last request as net/http hands it to a handler.
type store struct {
	*httptest.Server
	last *http.Request
}

func newStore(t *testing.T) *store {
	s := &store{}
	s.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { s.last = r }))
	t.Cleanup(s.Close)
	return s
}

// send delivers req and returns it as received.
func (s *store) send(t *testing.T, req *http.Request) *http.Request {
	t.Helper()
	if _, err := http.DefaultClient.Do(req); err != nil {
		t.Fatal(err)
	}
	return s.last
}

var srv *store

func received(t *testing.T, req *http.Request) *http.Request { return srv.send(t, req) }

func TestMain(m *testing.M) {
	t := &testing.T{}
	srv = newStore(t)
	m.Run()
}

func sign(t *testing.T, method, target, secret string, at time.Time, body string) *http.Request {
	t.Helper()
	req, err := http.NewRequest(method, strings.Replace(target, "http://h", srv.URL, 1), strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	sum := sha256.Sum256([]byte(body))
	hash := hex.EncodeToString(sum[:])
	req.Header.Set("X-Amz-Content-Sha256", hash)
	creds := aws.Credentials{AccessKeyID: "AKIDLOCAL", SecretAccessKey: secret}
	if err := s3Signer().SignHTTP(context.Background(), creds, req, hash, "s3", "us-east-1", at); err != nil {
		t.Fatal(err)
	}
	return req
}

// s3Signer signs as S3 clients do: the path encoded once, as sent (other services encode it twice).
func s3Signer() *v4.Signer {
	return v4.NewSigner(func(o *v4.SignerOptions) { o.DisableURIPathEscaping = true })
}

func TestHeaderSignatureRoundTrip(t *testing.T) {
	now := time.Now().UTC()
	for _, target := range []string{"http://h/bucket/data/a%20b/%C3%A9.txt", "http://h/bucket?list-type=2&prefix=a%2Fb&delimiter=%2F", "http://h/"} {
		r := received(t, sign(t, "GET", target, "s3cr3t", now, ""))
		if err := verify(r, testCreds, now, time.Minute); err != nil {
			t.Errorf("%s: %v", target, err)
		}
	}
}

func TestWrongSecretOrKeyIsRefused(t *testing.T) {
	now := time.Now().UTC()
	r := received(t, sign(t, "PUT", "http://h/bucket/key", "not-the-secret", now, "payload"))
	if err := verify(r, testCreds, now, time.Minute); !errors.Is(err, errSignature) {
		t.Errorf("wrong secret: %v", err)
	}
	r = received(t, sign(t, "PUT", "http://h/bucket/key", "s3cr3t", now, "payload"))
	if err := verify(r, Credentials{"OTHER": "s3cr3t"}, now, time.Minute); err == nil || !strings.Contains(err.Error(), "InvalidAccessKeyId") {
		t.Errorf("unknown key: %v", err)
	}
	if err := verify(r, testCreds, now.Add(time.Hour), time.Minute); err == nil || !strings.Contains(err.Error(), "RequestTimeTooSkewed") {
		t.Errorf("old request: %v", err)
	}
	plain, _ := http.NewRequest("GET", srv.URL+"/bucket/key", nil)
	unsigned := received(t, plain)
	if err := verify(unsigned, testCreds, now, time.Minute); err == nil {
		t.Error("an unsigned request must be refused")
	}
}

func TestPresignedURL(t *testing.T) {
	now := time.Now().UTC()
	req, _ := http.NewRequest("PUT", srv.URL+"/bucket/uploads/x%2By.tgz?X-Amz-Expires=600", nil)
	creds := aws.Credentials{AccessKeyID: "AKIDLOCAL", SecretAccessKey: "s3cr3t"}
	signedURL, header, err := s3Signer().PresignHTTP(context.Background(), creds, req, "UNSIGNED-PAYLOAD", "s3", "us-east-1", now)
	if err != nil {
		t.Fatal(err)
	}
	put, _ := http.NewRequest("PUT", signedURL, strings.NewReader("bytes"))
	for k, v := range header {
		put.Header[k] = v
	}
	r := received(t, put)
	if err := verify(r, testCreds, now, time.Minute); err != nil {
		t.Fatalf("presigned: %v", err)
	}
	if err := verify(r, testCreds, now.Add(11*time.Minute), time.Minute); err == nil || !strings.Contains(err.Error(), "expired") {
		t.Errorf("expired: %v", err)
	}
	tampered, _ := http.NewRequest("PUT", strings.Replace(signedURL, "x%2By.tgz", "other.tgz", 1), strings.NewReader("bytes"))
	if err := verify(received(t, tampered), testCreds, now, time.Minute); !errors.Is(err, errSignature) {
		t.Errorf("tampered path: %v", err)
	}
}
