package main

import (
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"sort"
	"strings"
	"time"
)

// AWS Signature Version 4, checked the way S3 checks it: the request is put in canonical form, signed
// again with the secret key of the access key it names, and the two signatures must match. Both forms
// are accepted: the Authorization header and presigned URLs (X-Amz-* query parameters, which Flyte's
// admin hands out for uploads). The payload is taken as the client declared it (X-Amz-Content-Sha256,
// UNSIGNED-PAYLOAD or STREAMING-*); for aws-chunked uploads only the seed signature is checked, not each
// chunk's.

const algorithm = "AWS4-HMAC-SHA256"

// Credentials maps an access key id to its secret key.
type Credentials map[string]string

type sigv4Request struct {
	accessKey     string
	date          string // yyyymmdd
	region        string
	service       string
	signedHeaders []string
	signature     string
	amzDate       string // yyyymmddThhmmssZ
	payloadHash   string
	presigned     bool
	expires       time.Duration
}

// errSignature is an invalid signature (403 SignatureDoesNotMatch); other errors are 403 AccessDenied
// or InvalidAccessKeyId as named.
var errSignature = errors.New("SignatureDoesNotMatch")

type authError struct {
	code, message string
}

func (e *authError) Error() string { return e.code + ": " + e.message }

// verify checks r's signature against creds at time now.
func verify(r *http.Request, creds Credentials, now time.Time, skew time.Duration) error {
	parsed, err := parseSigV4(r)
	if err != nil {
		return err
	}
	secret, ok := creds[parsed.accessKey]
	if !ok {
		return &authError{"InvalidAccessKeyId", "The AWS Access Key Id you provided does not exist in our records."}
	}
	signedAt, err := time.Parse("20060102T150405Z", parsed.amzDate)
	if err != nil {
		return &authError{"AccessDenied", "X-Amz-Date is not a valid date"}
	}
	if parsed.presigned {
		if now.After(signedAt.Add(parsed.expires)) {
			return &authError{"AccessDenied", "Request has expired"}
		}
	} else if d := now.Sub(signedAt); d > skew || d < -skew {
		return &authError{"RequestTimeTooSkewed", "The difference between the request time and the current time is too large."}
	}
	scope := strings.Join([]string{parsed.date, parsed.region, parsed.service, "aws4_request"}, "/")
	canonical := canonicalRequest(r, parsed)
	digest := sha256.Sum256([]byte(canonical))
	toSign := strings.Join([]string{algorithm, parsed.amzDate, scope, hex.EncodeToString(digest[:])}, "\n")
	key := hmacSHA256([]byte("AWS4"+secret), parsed.date)
	for _, part := range []string{parsed.region, parsed.service, "aws4_request"} {
		key = hmacSHA256(key, part)
	}
	expected := hex.EncodeToString(hmacSHA256(key, toSign))
	if !hmac.Equal([]byte(expected), []byte(parsed.signature)) {
		return errSignature
	}
	return nil
}

func hmacSHA256(key []byte, data string) []byte {
	mac := hmac.New(sha256.New, key)
	mac.Write([]byte(data))
	return mac.Sum(nil)
}

func parseSigV4(r *http.Request) (*sigv4Request, error) {
	query := r.URL.Query()
	p := &sigv4Request{}
	var credential string
	if query.Get("X-Amz-Algorithm") != "" {
		if query.Get("X-Amz-Algorithm") != algorithm {
			return nil, &authError{"AccessDenied", "only " + algorithm + " is supported"}
		}
		p.presigned = true
		credential = query.Get("X-Amz-Credential")
		p.signedHeaders = strings.Split(query.Get("X-Amz-SignedHeaders"), ";")
		p.signature = query.Get("X-Amz-Signature")
		p.amzDate = query.Get("X-Amz-Date")
		seconds, err := time.ParseDuration(query.Get("X-Amz-Expires") + "s")
		if err != nil {
			return nil, &authError{"AccessDenied", "X-Amz-Expires is not a number of seconds"}
		}
		p.expires = seconds
		p.payloadHash = "UNSIGNED-PAYLOAD"
	} else {
		auth := r.Header.Get("Authorization")
		rest, ok := strings.CutPrefix(auth, algorithm+" ")
		if !ok {
			return nil, &authError{"AccessDenied", "the request is not signed with " + algorithm}
		}
		for _, field := range strings.Split(rest, ",") {
			name, value, _ := strings.Cut(strings.TrimSpace(field), "=")
			switch name {
			case "Credential":
				credential = value
			case "SignedHeaders":
				p.signedHeaders = strings.Split(value, ";")
			case "Signature":
				p.signature = value
			}
		}
		p.amzDate = r.Header.Get("X-Amz-Date")
		p.payloadHash = r.Header.Get("X-Amz-Content-Sha256")
		if p.payloadHash == "" {
			p.payloadHash = "UNSIGNED-PAYLOAD"
		}
	}
	parts := strings.Split(credential, "/")
	if len(parts) != 5 || parts[4] != "aws4_request" || p.signature == "" {
		return nil, &authError{"AccessDenied", "malformed credential scope or missing signature"}
	}
	p.accessKey, p.date, p.region, p.service = parts[0], parts[1], parts[2], parts[3]
	return p, nil
}

func canonicalRequest(r *http.Request, p *sigv4Request) string {
	path := r.URL.EscapedPath()
	if raw := strings.SplitN(r.RequestURI, "?", 2)[0]; strings.HasPrefix(raw, "/") {
		path = raw // the path as the client encoded it (S3 does not normalise or re-encode it)
	}
	if path == "" {
		path = "/"
	}
	var headers strings.Builder
	for _, name := range p.signedHeaders {
		var value string
		if name == "host" {
			value = r.Host
		} else {
			value = strings.Join(r.Header.Values(http.CanonicalHeaderKey(name)), ",")
		}
		fmt.Fprintf(&headers, "%s:%s\n", name, strings.Join(strings.Fields(value), " "))
	}
	return strings.Join([]string{
		r.Method, path, canonicalQuery(r.URL.RawQuery, p.presigned), headers.String(),
		strings.Join(p.signedHeaders, ";"), p.payloadHash,
	}, "\n")
}

// canonicalQuery sorts the parameters by name, then value, each URI-encoded (RFC 3986, '%XX' upper case).
func canonicalQuery(raw string, presigned bool) string {
	type pair struct{ key, value string }
	var pairs []pair
	for _, part := range strings.Split(raw, "&") {
		if part == "" {
			continue
		}
		key, value, _ := strings.Cut(part, "=")
		k, errK := url.QueryUnescape(key)
		v, errV := url.QueryUnescape(value)
		if errK != nil || errV != nil {
			k, v = key, value
		}
		if presigned && k == "X-Amz-Signature" {
			continue
		}
		pairs = append(pairs, pair{uriEncode(k), uriEncode(v)})
	}
	sort.Slice(pairs, func(i, j int) bool {
		if pairs[i].key != pairs[j].key {
			return pairs[i].key < pairs[j].key
		}
		return pairs[i].value < pairs[j].value
	})
	out := make([]string, len(pairs))
	for i, p := range pairs {
		out[i] = p.key + "=" + p.value
	}
	return strings.Join(out, "&")
}

func uriEncode(s string) string {
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		c := s[i]
		if ('A' <= c && c <= 'Z') || ('a' <= c && c <= 'z') || ('0' <= c && c <= '9') || strings.IndexByte("-_.~", c) >= 0 {
			b.WriteByte(c)
		} else {
			fmt.Fprintf(&b, "%%%02X", c)
		}
	}
	return b.String()
}
