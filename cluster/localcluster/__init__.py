"""A real Kubernetes control plane, Flyte and the training operator on one machine, as ordinary processes.

`python -m localcluster up|down|status|logs COMPONENT` (or `bash scripts/cluster.sh ...`): etcd,
kube-apiserver, kube-scheduler and kube-controller-manager, a node that runs pods as host processes, the
Kubeflow training operator, PostgreSQL and an S3 object store; then `helm install` of charts/fuseforge
runs Flyte on that node. Everything binds to loopback, is built once per version into a cache, and is
stopped by the pid it was started with.
"""
