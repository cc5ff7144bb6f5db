package main

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/jackc/pgx/v5"

	"github.com/deferq/scheduler/internal/defer/protocol"
	"github.com/deferq/scheduler/internal/pgtest"
)

// orderedQueue returns an ordered bare queue on a fresh database, without
// Kafka: these tests drive its statements directly.
func orderedQueue(t *testing.T) *bareQueue {
	t.Helper()
	db := pgtest.NewDB(t)
	if _, err := db.Pool.Exec(t.Context(), orderedSchema); err != nil {
		t.Fatal(err)
	}
	return &bareQueue{db: &database{name: db.Name, pool: db.Pool}, ordered: true,
		rules: protocol.Rules{Targets: protocol.TargetPatterns{"bench.*"}, MaxDelay: time.Hour}}
}

// records returns one due-now record per key, as the bench produces them
// (the record key is the business key; "" is a record without one), at
// offsets from first on.
func records(first int64, keys ...string) []*sarama.ConsumerMessage {
	msgs := make([]*sarama.ConsumerMessage, len(keys))
	for i, k := range keys {
		pm := deferRecord(k, int(first)+i, topicE2E, when{})
		m := &sarama.ConsumerMessage{Topic: deferTopic, Offset: first + int64(i), Value: []byte(fmt.Sprintf("%d", first+int64(i)))}
		if k != "" {
			m.Key = []byte(k)
		}
		for _, h := range pm.Headers {
			m.Headers = append(m.Headers, &sarama.RecordHeader{Key: h.Key, Value: h.Value})
		}
		msgs[i] = m
	}
	return msgs
}

// claimed is one row a claim returned: its id and its record's value.
type claimed struct {
	id    int64
	key   string
	value string
}

// claimIn runs orderedClaim in tx and returns what it took.
func claimIn(t *testing.T, tx pgx.Tx) []claimed {
	t.Helper()
	rows, err := tx.Query(t.Context(), orderedClaim, claimKeys)
	if err != nil {
		t.Fatal(err)
	}
	out, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (claimed, error) {
		var (
			c      claimed
			due    time.Time
			key    []byte
			value  []byte
			target string
			hk     []string
			hv     [][]byte
		)
		err := row.Scan(&c.id, &due, &target, &key, &value, &hk, &hv)
		c.key, c.value = string(key), string(value)
		return c, err
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// claim runs one claim and commits it, as publishDue does once published.
func claim(t *testing.T, q *bareQueue) []claimed {
	t.Helper()
	tx, err := q.db.pool.Begin(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	out := claimIn(t, tx)
	if err := tx.Commit(t.Context()); err != nil {
		t.Fatal(err)
	}
	return out
}

// The ordered bare queue hands out a key's messages one claim at a time,
// in the order they were stored, across batches; records without a key
// are each their own head.
func TestOrderedBareQueueKeepsKeyOrder(t *testing.T) {
	q := orderedQueue(t)
	ctx := t.Context()
	if err := q.store(ctx, 0, records(0, "a", "b", "a", "", "a")); err != nil {
		t.Fatal(err)
	}
	if err := q.store(ctx, 0, records(5, "b", "a", "")); err != nil {
		t.Fatal(err)
	}
	// Offsets in the order each key's records must go out.
	want := map[string][]string{"a": {"0", "2", "4", "6"}, "b": {"1", "5"}}
	got := map[string][]string{}
	var unkeyed, rounds int
	for rounds = 0; rounds < 10; rounds++ {
		out := claim(t, q)
		if len(out) == 0 {
			break
		}
		seen := map[string]bool{}
		for _, c := range out {
			if c.key == "" {
				unkeyed++
				continue
			}
			if seen[c.key] {
				t.Errorf("claim %d took two messages of key %q: %v", rounds, c.key, out)
			}
			seen[c.key] = true
			got[c.key] = append(got[c.key], c.value)
		}
	}
	for k, w := range want {
		if fmt.Sprint(got[k]) != fmt.Sprint(w) {
			t.Errorf("key %q went out as records %v, want %v", k, got[k], w)
		}
	}
	if unkeyed != 2 {
		t.Errorf("%d records without a key went out, want 2", unkeyed)
	}
	// a's four messages need four claims: one each.
	if rounds != 4 {
		t.Errorf("everything went out in %d claims, want 4", rounds)
	}
	var left int
	if err := q.db.pool.QueryRow(ctx, "SELECT count(*) FROM bare_message").Scan(&left); err != nil {
		t.Fatal(err)
	}
	if left != 0 {
		t.Errorf("%d rows left", left)
	}
}

// A record stored while a claim holds its key's head, and deletes it, must
// become the key's head once the claim commits: were it stored behind the
// head the claim deletes, the claim's promotion would not see it and the
// key would be left with no head, its message never claimed.
func TestOrderedBareQueueStoreWaitsForAClaimOfItsKey(t *testing.T) {
	q := orderedQueue(t)
	ctx := t.Context()
	if err := q.store(ctx, 0, records(0, "a")); err != nil {
		t.Fatal(err)
	}
	tx, err := q.db.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
	if out := claimIn(t, tx); len(out) != 1 || out[0].value != "0" {
		t.Fatalf("claimed %v, want record 0", out)
	}
	stored := make(chan error, 1)
	go func() { stored <- q.store(ctx, 0, records(1, "a")) }()
	// The store waits for the claim's lock on the head.
	deadline := time.Now().Add(10 * time.Second)
	for {
		var waiting int
		if err := q.db.pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity
			WHERE datname = current_database() AND wait_event_type = 'Lock'`).Scan(&waiting); err != nil {
			t.Fatal(err)
		}
		if waiting > 0 {
			break
		}
		select {
		case err := <-stored:
			t.Fatalf("the store finished (%v) while a claim held its key's head", err)
		default:
		}
		if time.Now().After(deadline) {
			t.Fatal("the store never waited for the claim")
		}
		time.Sleep(10 * time.Millisecond)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if err := <-stored; err != nil {
		t.Fatal(err)
	}
	if out := claim(t, q); len(out) != 1 || out[0].value != "1" {
		t.Errorf("after the claim committed, the next claim took %v, want record 1", out)
	}
}
