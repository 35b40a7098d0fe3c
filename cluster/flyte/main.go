// Command flyte runs Flyte's single-binary deployment as the flyte-binary chart starts it
// (`flyte start --config /etc/flyte/config.d/*.yaml`), with each Flyte service as its own process.
//
// The Go module proxy this project builds from serves no Flyte 1.16 flyteadmin or datacatalog module,
// so the services come from the releases it does serve, built in ../flyteadmin (flyteadmin and
// flytescheduler 1.13.0), ../flytepropeller (1.16.8) and ../datacatalog (1.0.46): they cannot share one
// binary (each pins other versions of the same Flyte libraries). This program does what the single
// binary's `start` does with them: database migrations, seed projects, then admin, the scheduler, the
// cluster resource controller, datacatalog and propeller (and its webhook), switched off by the same
// `flyte:` settings. All read the same configuration files. If one service exits, the rest are stopped
// and the exit code passed on, so the pod's restart policy applies.
package main

import (
	"fmt"
	"os"
)

func main() {
	if len(os.Args) < 2 || os.Args[1] != "start" {
		fmt.Fprintln(os.Stderr, "usage: flyte start --config '/etc/flyte/config.d/*.yaml'")
		os.Exit(2)
	}
	cfg, err := configFlag(os.Args[2:])
	if err != nil {
		fmt.Fprintln(os.Stderr, "flyte:", err)
		os.Exit(2)
	}
	os.Exit(start(cfg))
}

// configFlag returns the value of --config ("--config X" or "--config=X").
func configFlag(args []string) (string, error) {
	for i := 0; i < len(args); i++ {
		switch {
		case args[i] == "--config" && i+1 < len(args):
			return args[i+1], nil
		case len(args[i]) > len("--config=") && args[i][:len("--config=")] == "--config=":
			return args[i][len("--config="):], nil
		}
	}
	return "", fmt.Errorf("--config is required")
}
