package main

import (
	"strings"
	"testing"
)

// The fairness scenario alone (BENCH_ONLY=fair) in the smoke size: the
// backlog is made due and drains, the quiet target's records arrive, every
// message of both targets is there in per-key order, and the report has
// its table and RESULT keys. The lateness is not checked against the bar:
// make test must not depend on the machine's speed (make bench reports it).
func TestSmokeFair(t *testing.T) {
	cfg, report, vals := runSmoke(t, onlyFair)
	for _, k := range []string{"fair_quiet_p99_ms", "fair_quiet_p50_ms", "fair_quiet_max_ms", "fair_quiet_msgs",
		"fair_quiet_alone_p99_ms", "fair_backlog_msgs_per_s", "fair_cpu_speed", "fair_expected"} {
		if vals[k] <= 0 {
			t.Errorf("%s = %v, want a positive measurement", k, vals[k])
		}
	}
	if vals["fair_backlog_msgs"] != float64(cfg.FairBacklog) {
		t.Errorf("fair_backlog_msgs = %v, want %d", vals["fair_backlog_msgs"], cfg.FairBacklog)
	}
	// The warm-up, the backlog and at least the quiet records sent alone.
	if least := float64(cfg.Warmup + cfg.FairBacklog + cfg.FairRate); vals["fair_expected"] < least ||
		vals["fair_delivered"] != vals["fair_expected"] || vals["fair_out_of_order"] != 0 {
		t.Errorf("delivered %v of %v messages (want at least %v), %v out of per-key order",
			vals["fair_delivered"], vals["fair_expected"], least, vals["fair_out_of_order"])
	}
	for _, want := range []string{"FAIRNESS BETWEEN TARGETS", topicFairBacklog, topicFairQuiet, "due during the drain",
		"machine:", "speed:", "COMPARED WITH THE TARGETS", "quiet target p99 lateness"} {
		if !strings.Contains(report, want) {
			t.Errorf("report lacks %q", want)
		}
	}
	if t.Failed() {
		t.Logf("report:\n%s", report)
	}
}

func TestConfigFromEnvFairScale(t *testing.T) {
	for _, tc := range []struct {
		environ []string
		only    string
		backlog int
		largest int
	}{
		{[]string{"BENCH_ONLY=fair"}, onlyFair, 1_000_000, 10_000_000},
		{[]string{"BENCH_QUICK=1", "BENCH_ONLY=scale"}, onlyScale, 200_000, 1_000_000},
		{[]string{"BENCH_SMOKE=1", "BENCH_ONLY=scale"}, onlyScale, 2_000, 10_000},
	} {
		cfg, err := configFromEnv(tc.environ)
		if err != nil {
			t.Fatalf("configFromEnv(%q): %v", tc.environ, err)
		}
		if cfg.Only != tc.only || cfg.FairBacklog != tc.backlog || cfg.ScaleBacklogs[len(cfg.ScaleBacklogs)-1] != tc.largest {
			t.Errorf("configFromEnv(%q) = only %q, fair backlog %d, scale backlogs %v; want %q, %d, up to %d",
				tc.environ, cfg.Only, cfg.FairBacklog, cfg.ScaleBacklogs, tc.only, tc.backlog, tc.largest)
		}
	}
}
