package opscli

import (
	"context"
	"fmt"
	"io"
	"strconv"
	"time"

	"github.com/deferq/scheduler/internal/operate"
)

const heldHelp = `Usage: scheduler held [--json]

Lists the business keys whose head cannot move right now, and how many
pending messages of each wait behind it, in three kinds:

  held by a parked message  the head was parked and holds its key (its retry
                            policy says so, the default). Nothing of the key
                            moves until you replay it ("scheduler replay
                            --id ID") or cancel it ("scheduler cancel ID").
  backing off               publishing the head failed with a retriable error
                            (broker down); the key retries by itself.
  leased                    a dispatcher is publishing it: milliseconds,
                            unless a publish is stuck or its process died
                            (the lease then expires after LEASE_DURATION).

--json prints an array of objects with a "kind" of parked, backing_off or
leased. It runs the runbook file held_keys.sql.
`

// cmdHeld implements `scheduler held`.
func cmdHeld(ctx context.Context, args, environ []string, stdout, stderr io.Writer) int {
	o, fs := newOps("held", args, stdout, stderr)
	pos, done, code := o.parse(fs, args, heldHelp)
	if done {
		return code
	}
	if len(pos) > 0 {
		return o.exit(usagef("unexpected argument %q", pos[0]))
	}
	// printHeld says itself when no key is held.
	_, code, _ = showRunbook(ctx, o, environ, "held_keys.sql", map[string]string{"limit": ""}, "", func(w io.Writer, rows []operate.HeldKeyRow) {
		printHeld(w, rows, time.Now())
	})
	return code
}

func printHeld(w io.Writer, rows []operate.HeldKeyRow, now time.Time) {
	if len(rows) == 0 {
		fmt.Fprintln(w, "no key is held")
		return
	}
	kinds := []struct {
		kind, title string
		header      []string
		cells       func(h operate.HeldKeyRow) []string
	}{
		{
			operate.HeldParked, "Held by a parked message (replay or cancel it to release the key):",
			[]string{"PARKED AT", "REASON"},
			func(h operate.HeldKeyRow) []string {
				return []string{formatTimePtr(h.ParkedAt), printable(orDash(h.Reason), false)}
			},
		},
		{
			operate.HeldBackingOff, "Backing off after failed publishes (they retry by themselves):",
			[]string{"FAILURES", "RETRY", "ERROR CLASS"},
			func(h operate.HeldKeyRow) []string {
				return []string{strconv.Itoa(int(h.Failures)), retryAt(h.LeasedUntil, now), printable(orDash(h.ErrorClass), false)}
			},
		},
		{
			operate.HeldInFlight, "In flight: republished, waiting for the consumer group to commit (scheduler inflight; scheduler release):",
			nil,
			func(operate.HeldKeyRow) []string { return nil },
		},
		{
			operate.HeldLeased, "Leased by a dispatcher (publishing now):",
			[]string{"LEASED BY", "UNTIL"},
			func(h operate.HeldKeyRow) []string {
				return []string{printable(orDash(h.LeasedBy), false), formatTimePtr(h.LeasedUntil)}
			},
		},
	}
	first := true
	for _, k := range kinds {
		var t *table
		for _, h := range rows {
			if h.Kind != k.kind {
				continue
			}
			if t == nil {
				if !first {
					fmt.Fprintln(w)
				}
				first = false
				fmt.Fprintln(w, k.title)
				t = newTable(w, append([]string{"  KEY", "HEAD", "TARGET", "WAITING"}, k.header...)...)
			}
			key := "(unordered)"
			if h.BusinessKey != nil {
				key = printable(*h.BusinessKey, false)
			}
			t.row(append([]string{"  " + key, strconv.FormatInt(h.HeadID, 10), printable(orDash(h.TargetTopic), false),
				strconv.FormatInt(h.Waiting, 10)}, k.cells(h)...)...)
		}
		if t != nil {
			t.flush()
		}
	}
}

// retryAt says when a key backing off retries.
func retryAt(t *time.Time, now time.Time) string {
	if t == nil {
		return "-"
	}
	return relative(*t, now)
}
