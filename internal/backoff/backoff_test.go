package backoff

import (
	"context"
	"testing"
	"time"
)

func TestExp(t *testing.T) {
	tests := []struct {
		failures    int
		base, limit time.Duration
		want        time.Duration
	}{
		{0, time.Second, time.Minute, time.Second},
		{1, time.Second, time.Minute, time.Second},
		{2, time.Second, time.Minute, 2 * time.Second},
		{4, time.Second, time.Minute, 8 * time.Second},
		{10, time.Second, time.Minute, time.Minute},
		{1 << 30, time.Second, time.Minute, time.Minute}, // no overflow, no long loop
		{3, time.Second, 3 * time.Second, 3 * time.Second},
	}
	for _, tt := range tests {
		if got := Exp(tt.failures, tt.base, tt.limit); got != tt.want {
			t.Errorf("Exp(%d, %v, %v) = %v, want %v", tt.failures, tt.base, tt.limit, got, tt.want)
		}
	}
}

func TestSleep(t *testing.T) {
	if !Sleep(context.Background(), time.Millisecond) {
		t.Fatal("a full sleep must report true")
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	start := time.Now()
	if Sleep(ctx, time.Hour) {
		t.Fatal("a cancelled sleep must report false")
	}
	if time.Since(start) > time.Second {
		t.Fatal("a cancelled sleep must return at once")
	}
}
