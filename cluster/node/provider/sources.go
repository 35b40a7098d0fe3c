package provider

import (
	"context"
	"time"

	authv1 "k8s.io/api/authentication/v1"
	v1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
)

// apiSources reads ConfigMaps and Secrets one by one and requests tokens:
// the Node authorizer lets a node get exactly the objects its pods use, and
// never list them.
type apiSources struct {
	client kubernetes.Interface
}

const apiTimeout = 15 * time.Second

// forbiddenWait bounds how long a Forbidden answer is asked again: the Node
// authorizer learns that a pod is bound here from its own watch, so a node
// that starts the pod right after the binding can be refused for a moment.
// Flyte fails a task on the first CreateContainerConfigError it sees.
var forbiddenWait = 5 * time.Second

func retryForbidden[T any](get func(ctx context.Context) (T, error)) (T, error) {
	deadline := time.Now().Add(forbiddenWait)
	pause := 50 * time.Millisecond
	for {
		ctx, cancel := context.WithTimeout(context.Background(), apiTimeout)
		obj, err := get(ctx)
		cancel()
		if err == nil || !apierrors.IsForbidden(err) || time.Now().Add(pause).After(deadline) {
			return obj, err
		}
		time.Sleep(pause)
		pause *= 2
	}
}

func (s apiSources) ConfigMap(ns, name string) (*v1.ConfigMap, error) {
	return retryForbidden(func(ctx context.Context) (*v1.ConfigMap, error) {
		return s.client.CoreV1().ConfigMaps(ns).Get(ctx, name, metav1.GetOptions{})
	})
}

func (s apiSources) Secret(ns, name string) (*v1.Secret, error) {
	return retryForbidden(func(ctx context.Context) (*v1.Secret, error) {
		return s.client.CoreV1().Secrets(ns).Get(ctx, name, metav1.GetOptions{})
	})
}

// Token asks the TokenRequest API for a token bound to the pod, so it stops
// being valid when the pod is deleted (what kube-api-access volumes hold).
func (s apiSources) Token(pod *v1.Pod, sa, audience string, expirationSeconds int64) (string, time.Time, error) {
	ctx, cancel := context.WithTimeout(context.Background(), apiTimeout)
	defer cancel()
	tr := &authv1.TokenRequest{Spec: authv1.TokenRequestSpec{
		ExpirationSeconds: &expirationSeconds,
		BoundObjectRef:    &authv1.BoundObjectReference{Kind: "Pod", APIVersion: "v1", Name: pod.Name, UID: pod.UID},
	}}
	if audience != "" {
		tr.Spec.Audiences = []string{audience}
	}
	res, err := s.client.CoreV1().ServiceAccounts(pod.Namespace).CreateToken(ctx, sa, tr, metav1.CreateOptions{})
	if err != nil {
		return "", time.Time{}, err
	}
	return res.Status.Token, res.Status.ExpirationTimestamp.Time, nil
}
