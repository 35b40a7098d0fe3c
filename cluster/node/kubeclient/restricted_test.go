package kubeclient

import (
	"context"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/fake"
	"k8s.io/client-go/tools/cache"
)

// The wrapped client's Secret and ConfigMap informers sync at once and stay
// empty, without ever listing the real objects; other resources pass through.
func TestForNodeUtil(t *testing.T) {
	real := fake.NewSimpleClientset(
		&v1.Secret{ObjectMeta: metav1.ObjectMeta{Name: "s", Namespace: "ns"}},
		&v1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: "c", Namespace: "ns"}},
		&v1.Service{ObjectMeta: metav1.ObjectMeta{Name: "svc", Namespace: "ns"}},
	)
	c := ForNodeUtil(real)
	f := informers.NewSharedInformerFactory(c, time.Minute)
	secrets := f.Core().V1().Secrets()
	cms := f.Core().V1().ConfigMaps()
	svcs := f.Core().V1().Services()
	_ = secrets.Lister()
	_ = cms.Lister()
	_ = svcs.Lister()
	stop := make(chan struct{})
	defer close(stop)
	f.Start(stop)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if !cache.WaitForCacheSync(ctx.Done(), secrets.Informer().HasSynced, cms.Informer().HasSynced, svcs.Informer().HasSynced) {
		t.Fatal("informers did not sync")
	}
	if l, _ := secrets.Lister().List(labels.Everything()); len(l) != 0 {
		t.Errorf("secrets listed: %v", l)
	}
	if _, err := svcs.Lister().Services("ns").Get("svc"); err != nil {
		t.Errorf("services must pass through: %v", err)
	}
	if _, err := c.CoreV1().Secrets("ns").Get(context.Background(), "s", metav1.GetOptions{}); err != nil {
		t.Errorf("get must pass through: %v", err)
	}
}

// With a client that streams lists (WatchList), the quiet watch must end the
// empty initial list with the bookmark the reflector waits for.
func TestQuietWatchList(t *testing.T) {
	hidden := struct{ kubernetesInterface }{fake.NewSimpleClientset()}
	c := ForNodeUtil(hidden)
	f := informers.NewSharedInformerFactory(c, time.Minute)
	secrets := f.Core().V1().Secrets()
	cms := f.Core().V1().ConfigMaps()
	_ = secrets.Lister()
	_ = cms.Lister()
	stop := make(chan struct{})
	defer close(stop)
	f.Start(stop)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if !cache.WaitForCacheSync(ctx.Done(), secrets.Informer().HasSynced, cms.Informer().HasSynced) {
		t.Fatal("informers did not sync through the watch-list bookmark")
	}
}

type kubernetesInterface = kubernetes.Interface
