// Package kubernetes holds no code: its tests check the Kubernetes manifests
// in this directory offline. They are a module of their own so that the
// Kubernetes libraries they need stay out of the scheduler's go.mod, which
// users of its client package import; the scheduler itself comes in through
// the replace directive, so that the tests read the configuration, routes
// and memory formula of the code beside them.
package kubernetes
