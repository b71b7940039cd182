// Command pause is the sandbox ("pause") image of the single-node test cluster (hack/cluster): no registry is
// reachable, so containerd's sandbox_image is built locally from this. It holds the pod's namespaces until SIGTERM,
// SIGINT or SIGKILL, and reaps the zombies it inherits as PID 1 (as registry.k8s.io/pause does).
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	sig := make(chan os.Signal, 4)
	signal.Notify(sig, syscall.SIGTERM, syscall.SIGINT, syscall.SIGCHLD)
	for s := range sig {
		if s == syscall.SIGCHLD {
			for {
				var ws syscall.WaitStatus
				if pid, err := syscall.Wait4(-1, &ws, syscall.WNOHANG, nil); pid <= 0 || err != nil {
					break
				}
			}
			continue
		}
		os.Exit(0)
	}
}
