package service

import (
	"testing"
	"time"
)

// The backlog gauges refresh every METRICS_INTERVAL while counting is
// quick, and 20 times as long apart as a count takes once that is longer:
// counting a large backlog never takes more than a 20th of the time.
func TestBacklogWait(t *testing.T) {
	for _, tc := range []struct {
		interval, took, want time.Duration
	}{
		{15 * time.Second, 0, 15 * time.Second},
		{15 * time.Second, 100 * time.Millisecond, 15 * time.Second},
		{15 * time.Second, 750 * time.Millisecond, 15 * time.Second}, // exactly a 20th
		{15 * time.Second, time.Second, 20 * time.Second},
		{15 * time.Second, 4 * time.Second, 80 * time.Second}, // 10,000,000 rows on the bench machine
		{200 * time.Millisecond, 50 * time.Millisecond, time.Second},
		{time.Hour, time.Minute, time.Hour},
	} {
		if got := backlogWait(tc.interval, tc.took); got != tc.want {
			t.Errorf("backlogWait(%v, %v) = %v, want %v", tc.interval, tc.took, got, tc.want)
		}
	}
}
