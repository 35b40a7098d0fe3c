// Command kube is one binary for the control plane's Kubernetes half: etcd, kube-apiserver,
// kube-scheduler and kube-controller-manager, chosen by the first argument. One binary links the
// shared Kubernetes packages once, which keeps the cold build of the local cluster short.
package main

import (
	"fmt"
	"os"

	"github.com/spf13/cobra"
	"go.etcd.io/etcd/server/v3/etcdmain"
	"k8s.io/component-base/cli"
	apiserver "k8s.io/kubernetes/cmd/kube-apiserver/app"
	controllermanager "k8s.io/kubernetes/cmd/kube-controller-manager/app"
	scheduler "k8s.io/kubernetes/cmd/kube-scheduler/app"
)

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: kube etcd|kube-apiserver|kube-scheduler|kube-controller-manager [flags]")
		os.Exit(2)
	}
	component, args := os.Args[1], os.Args[2:]
	switch component {
	case "etcd":
		etcdmain.Main(append([]string{"etcd"}, args...))
		return
	case "kube-apiserver":
		os.Exit(run(apiserver.NewAPIServerCommand(), args))
	case "kube-scheduler":
		os.Exit(run(scheduler.NewSchedulerCommand(), args))
	case "kube-controller-manager":
		os.Exit(run(controllermanager.NewControllerManagerCommand(), args))
	default:
		fmt.Fprintf(os.Stderr, "kube: unknown component %q (etcd, kube-apiserver, kube-scheduler, kube-controller-manager)\n", component)
		os.Exit(2)
	}
}

// run executes a Kubernetes component's command the way its own main does (logging flags, exit code).
func run(cmd *cobra.Command, args []string) int {
	cmd.SetArgs(args)
	return cli.Run(cmd)
}
