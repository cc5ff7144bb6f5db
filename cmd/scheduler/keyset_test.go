package main

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"testing"
	"time"

	"github.com/deferq/scheduler/deferclient"
)

// The blocked-key set (docs/design.md, "The blocked-key set"): the library
// loads its group's blocked keys at each assignment and follows their
// changes, and asks the scheduler only where the set cannot vouch.

// TestKeySetSchedulerDownAtRebalance: member b of a group defers charge for
// order 7 and leaves; the scheduler goes down before a, the new owner of
// the partition, could load the set or ask. a cannot know of b's deferral,
// so refund for order 7 must not reach its handler: the gate counts the
// key as unknown and defers refund behind it. Once the scheduler is back,
// charge comes back to a, then refund.
func TestKeySetSchedulerDownAtRebalance(t *testing.T) {
	for _, client := range kafkaClients {
		t.Run(client, func(t *testing.T) {
			s := newKeyOrderSetup(t)
			p := producer(t, s.brokers)
			outB := &handled{}
			b := s.consume(t, "payment-service", outB, failing("charge", 1<<30), consumeOpts{client: client})
			produceMain(t, p, "order-7", "charge")
			waitStat(t, b, func(st deferclient.Stats) bool { return st.Deferred >= 1 })
			s.scheduler.Kill()
			b.stop()

			outA := &handled{}
			a := s.consume(t, "payment-service", outA, nil, consumeOpts{client: client})
			produceMain(t, p, "order-7", "refund")
			waitStat(t, a, func(st deferclient.Stats) bool { return st.Gated >= 1 && st.FeedFailures >= 1 })
			if got := outA.snapshot(); len(got) != 0 {
				t.Fatalf("a handled %q while it could not know order-7's state", got)
			}

			s.restartScheduler(t)
			got := outA.waitFor(t, 2, time.Minute)
			if want := []string{"order-7=charge", "order-7=refund"}; !slices.Equal(got[:2], want) {
				t.Fatalf("a handled %q, want %q first", got, want)
			}
		})
	}
}

// TestKeySetOperatorFreesKey: a consumer holding the set learns that an
// operator freed a key, by cancel (the key's parked message) and by
// release (a key in flight for a group that never commits, since it does
// not consume its retry topic), and hands the key's next record to its
// handler without a question to the scheduler: main-topic records of keys
// the set says are free cost no query.
func TestKeySetOperatorFreesKey(t *testing.T) {
	for _, client := range kafkaClients {
		t.Run(client, func(t *testing.T) {
			s := newKeyOrderSetup(t)
			p := producer(t, s.brokers)
			out := &handled{}
			fail := func(_ context.Context, r record) error {
				switch {
				case r.key == "order-42" && r.value == "charge":
					return deferclient.Permanent(errors.New("card declined")) // parked, holding its key
				case r.key == "order-43" && r.value == "charge":
					return errors.New("provider timeout") // deferred, republished to a topic nobody reads
				}
				return nil
			}
			c := s.consume(t, "payment-service", out, fail, consumeOpts{client: client, topics: []string{mainTopic}})
			ops := []string{"DATABASE_URL=" + s.db.URL}

			// Cancel.
			produceMain(t, p, "order-42", "charge")
			waitStat(t, c, func(st deferclient.Stats) bool { return st.Deferred == 1 && st.BlockedKeys == 1 })
			var id int64
			if err := s.db.Pool.QueryRow(context.Background(),
				"SELECT id FROM deferred_message WHERE business_key = 'order-42' AND state = 'parked'").Scan(&id); err != nil {
				t.Fatal(err)
			}
			cliOK(t, ops, "cancel", strconv.FormatInt(id, 10))
			waitStat(t, c, func(st deferclient.Stats) bool { return st.BlockedKeys == 0 })
			produceMain(t, p, "order-42", "refund")
			out.waitFor(t, 1, 20*time.Second)

			// Release.
			produceMain(t, p, "order-43", "charge")
			waitBlockedFor(t, s, "payment-service", "order-43", deferclient.ReasonInFlight)
			waitStat(t, c, func(st deferclient.Stats) bool { return st.BlockedKeys == 1 })
			cliOK(t, ops, "release", "--group", "payment-service", "--key", "order-43")
			waitStat(t, c, func(st deferclient.Stats) bool { return st.BlockedKeys == 0 })
			produceMain(t, p, "order-43", "refund")
			got := out.waitFor(t, 2, 20*time.Second)

			if want := []string{"order-42=refund", "order-43=refund"}; !slices.Equal(got, want) {
				t.Errorf("handled %q, want %q", got, want)
			}
			st := c.client.Stats()
			if st.Gated != 0 || st.Queries != 0 || st.QueryFailures != 0 {
				t.Errorf("stats %+v: want no record gated and no key-state query, the set vouching for every key", st)
			}
		})
	}
}

// waitBlockedFor waits until key is blocked for group for reason, as the
// operators' deferred_key_state says (a consumer's KeyStates would count
// as a question).
func waitBlockedFor(t *testing.T, s *keyOrderSetup, group, key, reason string) {
	t.Helper()
	waitUntil(t, 20*time.Second, fmt.Sprintf("key %s blocked (%s)", key, reason), func() (bool, string) {
		var got *string
		err := s.db.Pool.QueryRow(context.Background(), "SELECT reason FROM deferred_key_state($1, ARRAY[$2])", group, key).Scan(&got)
		return err == nil && got != nil && *got == reason, fmt.Sprintf("%v, %v", got, err)
	})
}
