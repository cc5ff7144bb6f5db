package opscli

// Keys in flight for a consumer group: inflight lists them (inflight.sql),
// release deletes them for a group that will never commit
// (release_inflight.sql).

import (
	"context"
	"fmt"
	"io"
	"strconv"
	"strings"
	"time"

	"github.com/deferq/scheduler/internal/operate"
	"github.com/jackc/pgx/v5"
)

func printInflight(w io.Writer, rows []operate.InflightRow) {
	t := newTable(w, "GROUP", "KEY", "TARGET", "PARTITION", "OFFSET", "MESSAGE", "PUBLISHED AT", "AGE")
	for _, r := range rows {
		t.row(printable(r.GroupID, false), printable(r.BusinessKey, false), printable(r.TargetTopic, false),
			strconv.Itoa(int(r.Partition)), strconv.FormatInt(r.RecordOffset, 10), strconv.FormatInt(r.MessageID, 10),
			formatTime(r.PublishedAt), humanDuration(time.Duration(r.AgeSeconds*float64(time.Second))))
	}
	t.flush()
}

const inflightHelp = `Usage: scheduler inflight [--group GROUP] [--key KEY] [--limit N] [--json]

Lists the business keys in flight, oldest first: for each consumer group
that named itself in defer.group, the key's last record the scheduler
republished to each target partition, which the group has not committed
past yet. Meanwhile the key-state query answers that the key is blocked for
that group (in_flight). The scheduler releases a key about a second after
the group commits past its record, so keys listed for more than a few
seconds mean the group is not committing: stopped, far behind, deleted or
renamed. "scheduler release --group GROUP" releases a group that will never
commit. It runs the runbook file inflight.sql.
`

// cmdInflight implements `scheduler inflight`.
func cmdInflight(ctx context.Context, args, environ []string, stdout, stderr io.Writer) int {
	o, fs := newOps("inflight", args, stdout, stderr)
	group := fs.String("group", "", "only the keys of this consumer group (exact)")
	key := fs.String("key", "", "only this business key (exact)")
	limit := fs.Int("limit", 100, "print at most this many keys, 1..100000")
	pos, done, code := o.parse(fs, args, inflightHelp)
	if done {
		return code
	}
	if len(pos) > 0 {
		return o.exit(usagef("unexpected argument %q", pos[0]))
	}
	if *limit < 1 || *limit > 100000 {
		return o.exit(usagef("--limit %d is out of range: want 1..100000", *limit))
	}
	empty := "no key is in flight"
	if *group != "" {
		empty += " for group " + printable(*group, false)
	}
	vars := map[string]string{"group": *group, "key": *key, "limit": strconv.Itoa(*limit)}
	rows, code, done := showRunbook(ctx, o, environ, "inflight.sql", vars, empty, printInflight)
	if done {
		return code
	}
	if len(rows) == *limit {
		fmt.Fprintf(o.stdout, "(the oldest %d; --limit shows more)\n", *limit)
	}
	return 0
}

const releaseHelp = `Usage: scheduler release --group GROUP [--key KEY] [--dry-run] [--json]

Releases the keys in flight for consumer group GROUP (only KEY's with
--key): the key-state query stops answering in_flight for them at once,
without waiting for the group to commit past the last record the scheduler
republished. Use it for a group that will never commit (deleted, renamed,
stuck for good): if a released key's record was not consumed yet, a later
record of the key may be handled before it. --dry-run lists what it would
release and changes nothing. It runs the runbook file release_inflight.sql
(inflight.sql for --dry-run); "scheduler inflight" lists every group's keys.
`

// releaseReport is what release prints with --json.
type releaseReport struct {
	Group string  `json:"group"`
	Key   *string `json:"key"` // null: every key of the group
	// DryRun: nothing was released; Matched says what would have been.
	DryRun   bool                  `json:"dry_run"`
	Matched  int                   `json:"matched"`
	Released int                   `json:"released"`
	Keys     []operate.InflightRow `json:"keys"`
}

// cmdRelease implements `scheduler release`.
func cmdRelease(ctx context.Context, args, environ []string, stdout, stderr io.Writer) int {
	o, fs := newOps("release", args, stdout, stderr)
	group := fs.String("group", "", "the consumer group whose keys to release (required)")
	key := fs.String("key", "", "release only this business key")
	dryRun := fs.Bool("dry-run", false, "print what would be released and change nothing")
	pos, done, code := o.parse(fs, args, releaseHelp)
	if done {
		return code
	}
	if len(pos) > 0 {
		return o.exit(usagef("unexpected argument %q", pos[0]))
	}
	if strings.TrimSpace(*group) == "" {
		return o.exit(usagef("--group is required: the consumer group whose keys to release (scheduler inflight lists them)"))
	}
	rep := releaseReport{Group: *group, DryRun: *dryRun}
	if *key != "" {
		rep.Key = key
	}
	err := o.withConn(ctx, environ, func(conn *pgx.Conn) error {
		return o.inTx(ctx, conn, readCommitted(), func(tx pgx.Tx) (err error) {
			if *dryRun {
				rep.Keys, err = operate.Rows[operate.InflightRow](ctx, tx, "inflight.sql", map[string]string{"group": *group, "key": *key, "limit": ""})
			} else {
				rep.Keys, err = operate.Rows[operate.InflightRow](ctx, tx, "release_inflight.sql", map[string]string{"group": *group, "key": *key})
			}
			return err
		})
	})
	if err != nil {
		return o.exit(err)
	}
	rep.Matched = len(rep.Keys)
	if !*dryRun {
		rep.Released = len(rep.Keys)
	}
	if o.json {
		return o.exit(o.printJSON(rep))
	}
	return o.exit(rep.print(o.stdout))
}

// print prints the keys released (or that would be), then what happened.
func (r releaseReport) print(w io.Writer) error {
	what := "group " + printable(r.Group, false)
	if r.Key != nil {
		what += ", key " + printable(*r.Key, false)
	}
	if len(r.Keys) == 0 {
		_, err := fmt.Fprintf(w, "no key is in flight for %s; nothing released\n", what)
		return err
	}
	printInflight(w, r.Keys)
	keys := map[string]bool{}
	for _, k := range r.Keys {
		keys[k.BusinessKey] = true
	}
	count := fmt.Sprintf("%d key%s", len(keys), plural(len(keys), "", "s"))
	if len(keys) != len(r.Keys) {
		count += fmt.Sprintf(" (%d target partitions)", len(r.Keys))
	}
	if r.DryRun {
		_, err := fmt.Fprintf(w, "dry run: would release %s of %s; nothing changed\n", count, what)
		return err
	}
	_, err := fmt.Fprintf(w, "released %s of %s\n", count, what)
	return err
}
