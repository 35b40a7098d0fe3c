package provider

import (
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"
)

// A Secret refused while the Node authorizer has not yet seen the pod's binding is asked again.
func TestSecretForbiddenAtFirstIsAskedAgain(t *testing.T) {
	client := fake.NewSimpleClientset(&v1.Secret{ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: "keys"}})
	refusals := 2
	client.PrependReactor("get", "secrets", func(k8stesting.Action) (bool, runtime.Object, error) {
		if refusals > 0 {
			refusals--
			return true, nil, apierrors.NewForbidden(schema.GroupResource{Resource: "secrets"}, "keys",
				nil)
		}
		return false, nil, nil
	})
	secret, err := apiSources{client: client}.Secret("ns", "keys")
	if err != nil || secret.Name != "keys" || refusals != 0 {
		t.Fatalf("secret %v, err %v, refusals left %d", secret, err, refusals)
	}
}

// A refusal that lasts is reported once forbiddenWait has passed; other errors at once.
func TestLastingRefusalAndOtherErrorsAreReported(t *testing.T) {
	saved := forbiddenWait
	forbiddenWait = 300 * time.Millisecond
	defer func() { forbiddenWait = saved }()
	client := fake.NewSimpleClientset()
	client.PrependReactor("get", "configmaps", func(k8stesting.Action) (bool, runtime.Object, error) {
		return true, nil, apierrors.NewForbidden(schema.GroupResource{Resource: "configmaps"}, "c", nil)
	})
	start := time.Now()
	if _, err := (apiSources{client: client}).ConfigMap("ns", "c"); !apierrors.IsForbidden(err) {
		t.Fatalf("want Forbidden, got %v", err)
	}
	if waited := time.Since(start); waited < 100*time.Millisecond || waited > 2*time.Second {
		t.Fatalf("waited %s", waited)
	}
	start = time.Now()
	if _, err := (apiSources{client: client}).Secret("ns", "missing"); !apierrors.IsNotFound(err) {
		t.Fatalf("want NotFound, got %v", err)
	}
	if time.Since(start) > 100*time.Millisecond {
		t.Fatalf("NotFound was retried")
	}
}
