package main

import (
	"fmt"
	"strings"
	"testing"
)

// The scaling curves alone (BENCH_ONLY=scale) in the smoke size: every
// point runs (one with two replicas on one database and broker, one with
// far-future rows), every message arrives in per-key order, and each point
// has its RESULT keys. Speed is not checked: make test must not depend on
// the machine.
func TestSmokeScale(t *testing.T) {
	cfg, report, vals := runSmoke(t, onlyScale)
	var keys []string
	for _, k := range cfg.ScaleLoops {
		keys = append(keys, fmt.Sprintf("scale_loops%d", k))
	}
	for _, r := range cfg.ScaleReplicas {
		keys = append(keys, fmt.Sprintf("scale_replicas%d", r))
	}
	for _, n := range cfg.ScaleBacklogs {
		keys = append(keys, fmt.Sprintf("scale_backlog%d", n))
	}
	for _, k := range keys {
		for _, suffix := range []string{"_msgs_per_s", "_speed"} {
			if vals[k+suffix] <= 0 {
				t.Errorf("%s = %v, want a positive measurement", k+suffix, vals[k+suffix])
			}
		}
		// Postgres's CPU is 0 when its processes are not readable; idle CPU
		// may well be 0; the service's, over a smoke phase of about 50 ms
		// counted in 10 ms ticks, can read 0 (it did on a fast machine).
		for _, suffix := range []string{"_svc_cpu_us_per_msg", "_pg_cpu_us_per_msg", "_idle_cpu_ms_per_s", "_settle_s"} {
			if _, ok := vals[k+suffix]; !ok {
				t.Errorf("RESULT lacks %s", k+suffix)
			}
		}
	}
	if vals["scale_expected"] == 0 || vals["scale_delivered"] != vals["scale_expected"] || vals["scale_out_of_order"] != 0 {
		t.Errorf("delivered %v of %v messages, %v out of per-key order", vals["scale_delivered"], vals["scale_expected"], vals["scale_out_of_order"])
	}
	for _, want := range []string{"SCALING", "published per replica", "machine:", "speed:", "settle"} {
		if !strings.Contains(report, want) {
			t.Errorf("report lacks %q", want)
		}
	}
	if t.Failed() {
		t.Logf("report:\n%s", report)
	}
}
