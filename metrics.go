package icebergidempotency

import (
	"errors"

	"github.com/prometheus/client_golang/prometheus"
)

// Collectors live at package level and are registered in each config's
// registry, so counts carry across reloads and two handlers in one config
// share them.
var (
	decisions = prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: "caddy",
		Subsystem: "iceberg_idempotency",
		Name:      "requests_total",
		Help:      "Keyed Iceberg mutations by operation and what the handler did with them.",
	}, []string{"operation", "outcome"})

	executions = prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: "caddy",
		Subsystem: "iceberg_idempotency",
		Name:      "executions_total",
		Help:      "Mutations executed under a key, by operation and whether the response was stored (finalized) or not (released).",
	}, []string{"operation", "result"})

	memoryEvictions = prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: "caddy",
		Subsystem: "iceberg_idempotency",
		Name:      "memory_evictions_total",
		Help:      "Final records the memory store evicted before they expired, by the bound that pushed them out (entries: max_entries, bytes: max_bytes). Their keys execute again on retry.",
	}, []string{"reason"})
)

// Both eviction series exist from the start, so that a rate over them works
// before the first eviction.
func init() {
	memoryEvictions.WithLabelValues("entries")
	memoryEvictions.WithLabelValues("bytes")
}

// Request outcomes, the "outcome" label of requests_total.
const (
	outcomeNoKey            = "no_key"
	outcomeInvalidKey       = "invalid_key"
	outcomeExecuted         = "executed"
	outcomeReplayed         = "replayed"
	outcomeMismatch         = "mismatch"
	outcomeInFlight         = "in_flight"
	outcomeAbandoned        = "abandoned"
	outcomeUnreadable       = "unreadable"
	outcomeStoreUnavailable = "store_unavailable"
	outcomeFailOpen         = "fail_open"
)

func registerMetrics(reg *prometheus.Registry) error {
	if reg == nil {
		return nil
	}
	for _, c := range []prometheus.Collector{decisions, executions, memoryEvictions} {
		var already prometheus.AlreadyRegisteredError
		if err := reg.Register(c); err != nil && !errors.As(err, &already) {
			return err
		}
	}
	return nil
}
