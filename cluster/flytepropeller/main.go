// Command flytepropeller is FlytePropeller 1.16 (the controller and its pod webhook) from
// github.com/flyteorg/flyte/flytepropeller/cmd/controller, linked with the task plugins the platform
// uses: plain pods, PyTorchJobs (kfpytorch) and map tasks. Propeller's own main links every plugin,
// and the Go module proxy here does not serve the Spark operator module its Spark plugin needs.
package main

import (
	"github.com/flyteorg/flyte/flytepropeller/cmd/controller/cmd"
	_ "github.com/flyteorg/flyte/flyteplugins/go/tasks/plugins/array/k8s"
	_ "github.com/flyteorg/flyte/flyteplugins/go/tasks/plugins/k8s/kfoperators/pytorch"
	_ "github.com/flyteorg/flyte/flyteplugins/go/tasks/plugins/k8s/pod"
)

func main() {
	cmd.Execute()
}
