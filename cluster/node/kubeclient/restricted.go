// Package kubeclient adapts the node's client to what the Node authorizer
// lets a kubelet do.
package kubeclient

import (
	"context"

	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/kubernetes"
	corev1 "k8s.io/client-go/kubernetes/typed/core/v1"
	"k8s.io/client-go/util/watchlist"
)

// ForNodeUtil wraps c for virtual-kubelet's nodeutil, which starts
// cluster-wide Secret and ConfigMap informers. A node may not list those (it
// may only get the ones its own pods use, which the provider does directly),
// so the informers are fed an empty list and a quiet watch instead of
// retrying forbidden requests forever.
func ForNodeUtil(c kubernetes.Interface) kubernetes.Interface {
	return restricted{c}
}

type restricted struct{ kubernetes.Interface }

// IsWatchListSemanticsUnSupported forwards the wrapped client's answer
// (fake clientsets in tests say they cannot stream lists).
func (r restricted) IsWatchListSemanticsUnSupported() bool {
	return watchlist.DoesClientNotSupportWatchListSemantics(r.Interface)
}

func (r restricted) CoreV1() corev1.CoreV1Interface { return core{r.Interface.CoreV1()} }

type core struct{ corev1.CoreV1Interface }

func (c core) Secrets(ns string) corev1.SecretInterface {
	return emptySecrets{c.CoreV1Interface.Secrets(ns)}
}

func (c core) ConfigMaps(ns string) corev1.ConfigMapInterface {
	return emptyConfigMaps{c.CoreV1Interface.ConfigMaps(ns)}
}

type emptySecrets struct{ corev1.SecretInterface }

func (emptySecrets) List(context.Context, metav1.ListOptions) (*v1.SecretList, error) {
	return &v1.SecretList{ListMeta: metav1.ListMeta{ResourceVersion: "1"}}, nil
}

func (emptySecrets) Watch(_ context.Context, opts metav1.ListOptions) (watch.Interface, error) {
	return quietWatch(opts, &v1.Secret{}), nil
}

type emptyConfigMaps struct{ corev1.ConfigMapInterface }

func (emptyConfigMaps) List(context.Context, metav1.ListOptions) (*v1.ConfigMapList, error) {
	return &v1.ConfigMapList{ListMeta: metav1.ListMeta{ResourceVersion: "1"}}, nil
}

func (emptyConfigMaps) Watch(_ context.Context, opts metav1.ListOptions) (watch.Interface, error) {
	return quietWatch(opts, &v1.ConfigMap{}), nil
}

// quietWatch never delivers an object. For a watch-list request (initial
// events streamed through the watch) it first sends the bookmark that marks
// the end of the (empty) initial list.
func quietWatch(opts metav1.ListOptions, obj runtime.Object) watch.Interface {
	w := watch.NewFakeWithChanSize(1, false)
	if opts.SendInitialEvents != nil && *opts.SendInitialEvents {
		if m, err := meta.Accessor(obj); err == nil {
			m.SetResourceVersion("1")
			m.SetAnnotations(map[string]string{metav1.InitialEventsAnnotationKey: "true"})
		}
		w.Action(watch.Bookmark, obj)
	}
	return w
}
