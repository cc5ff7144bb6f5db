package ingest

import (
	"context"
	"fmt"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/deferq/scheduler/internal/pgtest"
)

// TestIngestLogsClaims checks that each session logs the partitions it
// claims and releases, with its generation and member ID, and each claim its
// start and end: what tells, from the services' logs, which process holds a
// partition (docs/chaos.md, finding 2). Records' keys and values stay out.
func TestIngestLogsClaims(t *testing.T) {
	db := pgtest.NewDB(t)
	k := newKafka(t)
	const group = "ingest-log-claims"
	k.produce(t, validRec(1, "business-key-secret", "payload-secret"))

	cg, err := NewConsumer(k.addrs, group, saramaConfig(), nil)
	if err != nil {
		t.Fatalf("consumer group: %v", err)
	}
	defer cg.Close()
	var logs testLog
	logger := slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelInfo}))
	in, err := NewIngester(cg.Group, NewStore(db.Pool, nil), IngestConfig{Topic: ingestTopic, Group: group, Log: cg.Log(),
		Rules: ingestRules(), BatchSize: 10, BatchLinger: 10 * time.Millisecond}, logger)
	if err != nil {
		t.Fatalf("NewIngester: %v", err)
	}
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan struct{})
	go func() {
		defer close(done)
		in.Run(ctx)
	}()
	waitRows(t, db.Pool, 1, 30*time.Second)
	cancel()
	select {
	case <-done:
	case <-time.After(30 * time.Second):
		t.Fatal("Run did not return within 30s of its context ending")
	}

	out := logs.String()
	t.Logf("logs:\n%s", out)
	var all []string
	for p := range int32(ingestPartitions) {
		all = append(all, fmt.Sprint(p))
	}
	parts := fmt.Sprintf(`partitions="[%s]"`, strings.Join(all, " "))
	lines := strings.Split(out, "\n")
	find := func(msg string, with ...string) string {
		t.Helper()
	line:
		for _, l := range lines {
			if !strings.Contains(l, `msg="`+msg+`"`) {
				continue
			}
			for _, w := range with {
				if !strings.Contains(l, w) {
					continue line
				}
			}
			return l
		}
		t.Errorf("no log line %q with %q", msg, with)
		return ""
	}
	claimed := find("ingest partitions claimed", "topic="+ingestTopic, parts, "generation=", "member=")
	find("ingest partitions released", "topic="+ingestTopic, parts, "generation=", "member=")
	for _, p := range all {
		find("ingest claim started", "partition="+p+" ", "generation=")
		find("ingest claim ended", "partition="+p+" ", `reason="session ended"`)
	}
	if strings.Contains(claimed, "member= ") || strings.Contains(claimed, `member=""`) {
		t.Errorf("claimed line without a member ID: %s", claimed)
	}
	for _, secret := range []string{"business-key-secret", "payload-secret"} {
		if strings.Contains(out, secret) {
			t.Errorf("logs contain a record's key or value %q", secret)
		}
	}
}
