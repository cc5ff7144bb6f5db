package opscli

import (
	"cmp"
	"context"
	"flag"
	"fmt"
	"io"
	"maps"
	"path"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/deferq/scheduler/internal/operate"
	"github.com/jackc/pgx/v5"
)

// previewBytes is how much of a value `show` prints without --full: enough
// to recognise a payload, little enough for one screen.
const previewBytes = 256

// rejectedWindow is the period `status` counts rejections over.
const rejectedWindow = "1 hour"

const statusHelp = `Usage: scheduler status [--json]

One screen on the scheduler's database (DATABASE_URL): the backlog by target
topic and state; how late dispatch is (the oldest key head that is due), and
why the other due messages wait (behind an earlier message of their key, in a
key held by a parked message or in flight, for a paused or rate-limited
target, backing off, being published); how many business keys are held (by a parked message, backing off after failed
publishes, or leased by a dispatcher; "scheduler held" lists them); and what
ingest rejected in the last hour, by reason.

It runs the runbook files backlog.sql, oldest_due.sql, held_keys.sql and
rejected_recent.sql (sql/runbook) in one snapshot; run those with psql for the
details.
`

// cmdStatus implements `scheduler status`.
func cmdStatus(ctx context.Context, args, environ []string, stdout, stderr io.Writer) int {
	o, fs := newOps("status", args, stdout, stderr)
	pos, done, code := o.parse(fs, args, statusHelp)
	if done {
		return code
	}
	if len(pos) > 0 {
		return o.exit(usagef("unexpected argument %q", pos[0]))
	}
	var s statusReport
	err := o.withConn(ctx, environ, func(conn *pgx.Conn) error {
		return o.inTx(ctx, conn, readOnly(), func(tx pgx.Tx) (err error) {
			s, err = readStatus(ctx, tx)
			return err
		})
	})
	if err != nil {
		return o.exit(err)
	}
	if o.json {
		return o.exit(o.printJSON(s))
	}
	s.print(o.stdout)
	return 0
}

// statusReport is what `status` prints.
type statusReport struct {
	Backlog          []operate.BacklogRow  `json:"backlog"`
	DueHeads         int64                 `json:"due_heads"`
	LatenessSeconds  float64               `json:"lateness_seconds"`
	OldestDue        *operate.OldestDueRow `json:"oldest_due"` // null when no head is due
	DueMessages      int64                 `json:"due_messages"`
	Waiting          dueWaits              `json:"waiting"` // why due messages wait
	HeldKeys         int                   `json:"held_keys"`
	ParkedKeys       int                   `json:"parked_keys"` // held by a parked message
	BackingOffKeys   int                   `json:"backing_off_keys"`
	InFlightKeys     int                   `json:"in_flight_keys"` // waiting for their consumer group's commit
	RejectedLastHour int64                 `json:"rejected_last_hour"`
	RejectedReasons  []operate.RejectedRow `json:"rejected_reasons"`
}

// dueWaits counts due pending messages that wait, by why (oldest_due.sql).
type dueWaits struct {
	Paused      int64 `json:"target_paused"`
	Parked      int64 `json:"key_held_by_parked"`
	InFlight    int64 `json:"key_in_flight"`
	Behind      int64 `json:"behind_earlier_message_of_key"`
	RateLimited int64 `json:"rate_limited"`
	BackingOff  int64 `json:"backing_off"`
	Leased      int64 `json:"being_published"`
}

// String lists the non-zero counts, e.g. "1 behind an earlier message of
// its key, 2 in a paused target".
func (w dueWaits) String() string {
	var parts []string
	for _, p := range []struct {
		n    int64
		what string
	}{
		{w.Behind, "behind an earlier message of its key"},
		{w.Parked, "in a key held by a parked message"},
		{w.InFlight, "in a key in flight (its consumer group has not committed)"},
		{w.Paused, "for a paused target"},
		{w.RateLimited, "waiting for its target's rate limit"},
		{w.BackingOff, "in a key backing off after failed publishes"},
		{w.Leased, "being published"},
	} {
		if p.n > 0 {
			parts = append(parts, fmt.Sprintf("%d %s", p.n, p.what))
		}
	}
	return strings.Join(parts, ", ")
}

func readStatus(ctx context.Context, q operate.Queryer) (statusReport, error) {
	var s statusReport
	var err error
	if s.Backlog, err = operate.Rows[operate.BacklogRow](ctx, q, "backlog.sql", nil); err != nil {
		return s, err
	}
	due, err := operate.Rows[operate.OldestDueRow](ctx, q, "oldest_due.sql", nil)
	if err != nil {
		return s, err
	}
	if len(due) != 1 {
		return s, fmt.Errorf("runbook oldest_due.sql: %d rows, want 1", len(due))
	}
	s.DueHeads, s.LatenessSeconds = due[0].DueHeads, due[0].LatenessSeconds
	if due[0].ID != nil {
		s.OldestDue = &due[0]
	}
	d := due[0]
	s.DueMessages = d.DueMessages
	s.Waiting = dueWaits{Paused: d.WaitingPaused, Parked: d.WaitingParked, InFlight: d.WaitingInFlight, Behind: d.WaitingBehind,
		RateLimited: d.WaitingRateLimited, BackingOff: d.WaitingBackingOff, Leased: d.WaitingLeased}
	held, err := operate.Rows[operate.HeldKeyRow](ctx, q, "held_keys.sql", map[string]string{"limit": ""})
	if err != nil {
		return s, err
	}
	s.HeldKeys = len(held)
	for _, h := range held {
		switch h.Kind {
		case operate.HeldParked:
			s.ParkedKeys++
		case operate.HeldBackingOff:
			s.BackingOffKeys++
		case operate.HeldInFlight:
			s.InFlightKeys++
		}
	}
	if s.RejectedReasons, err = operate.Rows[operate.RejectedRow](ctx, q, "rejected_recent.sql", map[string]string{"window": rejectedWindow}); err != nil {
		return s, err
	}
	for _, r := range s.RejectedReasons {
		s.RejectedLastHour += r.Messages
	}
	return s, nil
}

func (s statusReport) print(w io.Writer) {
	fmt.Fprintln(w, "Backlog by target and state:")
	if len(s.Backlog) == 0 {
		fmt.Fprintln(w, "  empty")
	} else {
		t := newTable(w, "  TARGET", "STATE", "MESSAGES", "DUE", "FIRST RUN AT", "LAST RUN AT")
		for _, b := range s.Backlog {
			t.row("  "+orDash(b.TargetTopic), b.State, strconv.FormatInt(b.Messages, 10), strconv.FormatInt(b.Due, 10),
				formatTimePtr(b.FirstRunAt), formatTimePtr(b.LastRunAt))
		}
		t.flush()
	}
	waits := s.Waiting.String()
	if o := s.OldestDue; o == nil {
		if waits == "" {
			fmt.Fprintln(w, "Lateness: none, no key head is due")
		} else {
			fmt.Fprintf(w, "Lateness: none, no key head is due; %d due message%s wait%s: %s\n", s.DueMessages,
				plural(s.DueMessages, "", "s"), plural(s.DueMessages, "s", ""), waits)
		}
	} else {
		fmt.Fprintf(w, "Lateness: %s: message %d (key %s, target %s) was due at %s; %d key head%s due\n",
			humanDuration(time.Duration(s.LatenessSeconds*float64(time.Second))), *o.ID,
			printable(orDash(o.BusinessKey), false), printable(orDash(o.TargetTopic), false),
			formatTimePtr(o.DueAt), s.DueHeads, plural(s.DueHeads, "", "s"))
		if waits != "" {
			fmt.Fprintf(w, "Due messages that wait: %s\n", waits)
		}
	}
	fmt.Fprintf(w, "Held keys: %d, %d by a parked message, %d backing off after failed publishes, %d in flight (scheduler held lists them)\n",
		s.HeldKeys, s.ParkedKeys, s.BackingOffKeys, s.InFlightKeys)
	if s.RejectedLastHour == 0 {
		fmt.Fprintln(w, "Rejected in the last hour: none")
	} else {
		var top []string
		for i, r := range s.RejectedReasons {
			if i == 5 {
				top = append(top, "...")
				break
			}
			top = append(top, fmt.Sprintf("%s %d", printable(r.Reason, false), r.Messages))
		}
		fmt.Fprintf(w, "Rejected in the last hour: %d (%s)\n", s.RejectedLastHour, strings.Join(top, ", "))
	}
}

const lsHelp = `Usage: scheduler ls [flags]

Lists messages in due order (next_run_at, then id): id, business key, seq,
target topic, state, due time (- for a rejected message: it never comes due),
attempt and reason. Filters combine; with none, the first messages of the
whole table. --json prints an array of objects. It runs the runbook file
list.sql.

The filters mean the same in every command:
  --target GLOB   target topic: * any run of characters, ? one, \ escapes;
                  a plain name is exact
  --reason CODE   reason code, exact: the part of the reason before the first
                  colon (listed below, and in the README's table)
  --key KEY       business key, exact

Examples:
  scheduler ls --state parked --target 'payments.*'
  scheduler ls --key order-42
  scheduler ls --state rejected --reason missing_target --json
`

// cmdLs implements `scheduler ls`.
func cmdLs(ctx context.Context, args, environ []string, stdout, stderr io.Writer) int {
	o, fs := newOps("ls", args, stdout, stderr)
	target := fs.String("target", "", "only messages whose target topic matches this glob (* any run, ? one character)")
	state := fs.String("state", "", "only messages in this state: "+strings.Join(messageStates(), ", "))
	key := fs.String("key", "", "only messages of this business key (exact)")
	reason := fs.String("reason", "", "only messages with this reason code, exact (the part of the reason before the colon)")
	limit := fs.Int("limit", 50, "print at most this many messages, 1..100000")
	pos, done, code := o.parse(fs, args, lsHelp+reasonCodesHelp())
	if done {
		return code
	}
	if len(pos) > 0 {
		return o.exit(usagef("unexpected argument %q", pos[0]))
	}
	if *state != "" && !slices.Contains(messageStates(), *state) {
		return o.exit(usagef("--state %q is not a state: want one of %s", *state, strings.Join(messageStates(), ", ")))
	}
	if *limit < 1 || *limit > 100000 {
		return o.exit(usagef("--limit %d is out of range: want 1..100000", *limit))
	}
	targetLike, err := targetFilter(*target)
	if err != nil {
		return o.exit(err)
	}
	if err := checkReasonCode(*reason); err != nil {
		return o.exit(err)
	}
	vars := map[string]string{"target": targetLike, "state": *state, "key": *key, "reason": *reason, "limit": strconv.Itoa(*limit)}
	rows, code, done := showRunbook(ctx, o, environ, "list.sql", vars, "no messages match", printMessages)
	if done {
		return code
	}
	if len(rows) == *limit {
		fmt.Fprintf(o.stdout, "(the first %d; --limit shows more)\n", *limit)
	}
	return 0
}

const showHelp = `Usage: scheduler show [--full] [--json] ID
       scheduler show --id ID

Shows one message: its row (where and when it goes, its state and why,
whether it heads its business key and how many messages of the key are ahead
of it or wait behind it, where it was read, when it was parked, its
dead-letter copy, how often it was replayed), its record key, its headers in
order, its value, its lineage (the message it re-defers, and those that
re-defer it), and the lineage's history: every time one of its messages was
deferred, parked, rejected, replayed, expedited, published or cancelled, with
the attempt, the error and who acted (cli:USER or console:USER for the
scheduler's commands, the database user for psql, - for the service itself).
A message that is gone says how its story ended (published to which
partition and offset, or cancelled by whom) above its history, until
HISTORY_RETENTION prunes it.
Keys, header values and the value are printed as text when they are valid
UTF-8, else as \x and hex; only their first 256 bytes unless --full.
It runs the runbook file show_message.sql.
`

// cmdShow implements `scheduler show`.
func cmdShow(ctx context.Context, args, environ []string, stdout, stderr io.Writer) int {
	o, fs := newOps("show", args, stdout, stderr)
	full := fs.Bool("full", false, "print keys and values whole, not their first 256 bytes")
	var flagIDs []int64
	fs.Var(idsValue{&flagIDs}, "id", "the message id (or give it as an argument)")
	pos, done, code := o.parse(fs, args, showHelp)
	if done {
		return code
	}
	ids, err := idArgs(pos, flagIDs)
	if err != nil {
		return o.exit(err)
	}
	if len(ids) != 1 {
		return o.exit(usagef("want one message id, got %d", len(ids)))
	}
	var st story
	err = o.withConn(ctx, environ, func(conn *pgx.Conn) error {
		return o.inTx(ctx, conn, readOnly(), func(tx pgx.Tx) (err error) {
			st, err = readStory(ctx, tx, ids[0])
			return err
		})
	})
	if err != nil {
		return o.exit(err)
	}
	if !*full {
		st.preview(previewBytes)
	}
	if st.Message == nil {
		st.End = storyEnd(st.History, ids[0])
	}
	if o.json {
		return o.exit(o.printJSON(st))
	}
	if st.Message == nil {
		st.printGone(o.stdout, ids[0])
		return 0
	}
	st.print(o.stdout, time.Now())
	return 0
}

// story is what `show` prints. Message is nil when the message is gone and
// only its history remains.
type story struct {
	Message *operate.MessageRow  `json:"message"`
	Headers []operate.HeaderRow  `json:"headers"`
	Lineage []operate.LineageRow `json:"lineage"`
	History []operate.HistoryRow `json:"history"`
	// End says how the story of a message no longer in the table ended
	// (published where, cancelled by whom); empty while it is there.
	End string `json:"end,omitempty"`
}

func readStory(ctx context.Context, q operate.Queryer, id int64) (story, error) {
	var st story
	const file = "show_message.sql"
	sts, err := operate.Statements(file, map[string]string{"id": strconv.FormatInt(id, 10)})
	if err != nil {
		return st, err
	}
	if len(sts) != 4 {
		return st, fmt.Errorf("runbook %s: %d statements, want 4", file, len(sts))
	}
	rows, err := operate.Collect[operate.MessageRow](ctx, q, sts[0])
	if err != nil {
		return st, operate.ExplainDBError(file, err)
	}
	if len(rows) > 0 {
		st.Message = &rows[0]
	}
	if st.Headers, err = operate.Collect[operate.HeaderRow](ctx, q, sts[1]); err != nil {
		return st, operate.ExplainDBError(file, err)
	}
	if st.Lineage, err = operate.Collect[operate.LineageRow](ctx, q, sts[2]); err != nil {
		return st, operate.ExplainDBError(file, err)
	}
	if st.History, err = operate.Collect[operate.HistoryRow](ctx, q, sts[3]); err != nil {
		return st, operate.ExplainDBError(file, err)
	}
	if st.Message == nil && len(st.History) == 0 {
		return st, fmt.Errorf("no message with id %d, and no history of one", id)
	}
	return st, nil
}

// preview cuts the key, header values and value to their first n bytes.
func (st *story) preview(n int) {
	m := st.Message
	if m == nil {
		return
	}
	m.Key, m.KeyTruncated = previewOf(m.Key, m.KeyEncoding, n)
	m.Value, m.ValueTruncated = previewOf(m.Value, m.ValueEncoding, n)
	for i := range st.Headers {
		h := &st.Headers[i]
		h.Value, h.Truncated = previewOf(h.Value, h.Encoding, n)
	}
}

func (st story) print(w io.Writer, now time.Time) {
	m := *st.Message
	var where string
	switch {
	case m.State == "parked" && m.HoldsKey:
		n := deref(m.WaitingBehind)
		where = fmt.Sprintf("parked, holding its key: %d pending message%s of the key wait behind it", n, plural(n, "", "s"))
	case m.State == "parked" && m.BusinessKey != nil && !m.ParkHoldsKey:
		where = "parked, its key goes on without it"
	case m.State != "pending":
		where = m.State
	case m.BusinessKey == nil:
		where = "pending, unordered (a head of its own)"
	case m.IsHead:
		where = "pending, head of its key"
	default:
		where = fmt.Sprintf("pending, behind %d pending message%s of its key", deref(m.PendingAhead), plural(deref(m.PendingAhead), "", "s"))
	}
	fmt.Fprintf(w, "Message %d: %s\n", m.ID, where)
	t := newTable(w)
	field := func(name, value string) { t.row("  "+name, value) }
	field("business key", printable(orDash(m.BusinessKey), false))
	field("seq", strconv.FormatInt(m.Seq, 10))
	field("target topic", printable(orDash(m.TargetTopic), false))
	field("next run at", formatTime(m.NextRunAt)+" ("+relative(m.NextRunAt, now)+")")
	field("attempt", strconv.Itoa(int(m.Attempt)))
	field("reason", printable(orDash(m.Reason), false))
	errText := orDash(m.ErrorClass)
	if m.ErrorMessage != nil {
		errText += ": " + *m.ErrorMessage
	}
	field("error", printable(errText, false))
	origin := "-"
	if m.OriginID != nil {
		origin = strconv.FormatInt(*m.OriginID, 10)
	}
	field("origin id", origin)
	source := "-"
	if m.SourceTopic != nil && m.SourcePartition != nil && m.SourceOffset != nil {
		source = fmt.Sprintf("%s partition %d offset %d", printable(*m.SourceTopic, false), *m.SourcePartition, *m.SourceOffset)
	}
	field("read from", source)
	field("created at", formatTime(m.CreatedAt))
	field("updated at", formatTime(m.UpdatedAt))
	if m.ParkedAt != nil {
		field("parked at", formatTime(*m.ParkedAt))
	}
	if m.DLQTopic != nil {
		dlq := printable(*m.DLQTopic, false)
		switch {
		case m.DLQPublishedAt != nil:
			dlq += ", copy sent at " + formatTime(*m.DLQPublishedAt)
		case m.State == "parked":
			dlq += ", copy not sent yet"
		}
		field("dead letter", dlq)
	}
	field("replayed", fmt.Sprintf("%d time%s", m.RedriveCount, plural(m.RedriveCount, "", "s")))
	t.flush()

	if m.Key == nil {
		fmt.Fprintln(w, "Key: none")
	} else {
		fmt.Fprintf(w, "Key (%s%s): %s\n", *m.KeyEncoding, truncatedNote(m.KeyTruncated), printable(*m.Key, false))
	}
	if len(st.Headers) == 0 {
		fmt.Fprintln(w, "Headers: none")
	} else {
		fmt.Fprintln(w, "Headers:")
		t := newTable(w, "  #", "KEY", "ENCODING", "VALUE")
		for _, h := range st.Headers {
			value := "-"
			if h.Value != nil {
				value = printable(*h.Value, false)
				if h.Truncated {
					value += " ..."
				}
			}
			t.row("  "+strconv.FormatInt(h.Position, 10), printable(orDash(h.Key), false), orDash(h.Encoding), value)
		}
		t.flush()
	}
	if m.Value == nil {
		fmt.Fprintln(w, "Value: none (null)")
	} else {
		fmt.Fprintf(w, "Value (%s, %d bytes%s):\n%s\n", *m.ValueEncoding, deref(m.ValueBytes), truncatedNote(m.ValueTruncated), printable(*m.Value, true))
	}
	if len(st.Lineage) == 0 {
		fmt.Fprintln(w, "Lineage: none")
	} else {
		fmt.Fprintln(w, "Lineage:")
		t := newTable(w, append([]string{"  RELATION"}, messageColumns()...)...)
		for _, l := range st.Lineage {
			t.row(append([]string{"  " + l.Relation}, messageCells(l.Message)...)...)
		}
		t.flush()
	}
	printHistory(w, st.History)
}

// printGone prints the story of a message that is no longer in the table:
// how it ended, then its history.
func (st story) printGone(w io.Writer, id int64) {
	fmt.Fprintf(w, "Message %d: %s\n", id, storyEnd(st.History, id))
	printHistory(w, st.History)
}

// storyEnd says how the story of message id, no longer in the table, ended:
// from its last history event.
func storyEnd(h []operate.HistoryRow, id int64) string {
	var last *operate.HistoryRow
	for i := range h {
		if h[i].MessageID == id {
			last = &h[i]
		}
	}
	switch {
	case last == nil:
		return "gone; its own history is pruned, its lineage's remains"
	case last.Event == "published":
		where := "to " + printable(orDash(last.TargetTopic), false)
		if last.Partition != nil && last.RecordOffset != nil {
			where += fmt.Sprintf(" partition %d offset %d", *last.Partition, *last.RecordOffset)
		}
		return fmt.Sprintf("delivered: published %s at %s (attempt %d)", where, formatTime(last.RecordedAt), last.Attempt)
	case last.Event == "cancelled":
		return fmt.Sprintf("cancelled by %s at %s, while %s", printable(orDash(last.Actor), false), formatTime(last.RecordedAt),
			cancelledWhile(h, id))
	default:
		return fmt.Sprintf("gone without a recorded end (its last event: %s at %s; recorded before deliveries and cancels were kept)",
			last.Event, formatTime(last.RecordedAt))
	}
}

// cancelledWhile names the state a cancelled message was in: that of the
// event before its cancel.
func cancelledWhile(h []operate.HistoryRow, id int64) string {
	state := "pending"
	for _, r := range h {
		if r.MessageID != id {
			continue
		}
		switch r.Event {
		case "parked", "rejected":
			state = r.Event
		case "deferred", "gated", "replayed", "expedited":
			state = "pending"
		}
	}
	return state
}

func printHistory(w io.Writer, h []operate.HistoryRow) {
	if len(h) == 0 {
		fmt.Fprintln(w, "History: none (pruned, or recorded before history was kept)")
		return
	}
	fmt.Fprintf(w, "History of lineage %d:\n", h[0].LineageID)
	t := newTable(w, "  RECORDED AT", "MESSAGE", "EVENT", "ATTEMPT", "TARGET", "DUE", "REASON", "ERROR", "BY")
	for _, r := range h {
		errText := "-"
		if r.ErrorClass != nil || r.ErrorMessage != nil {
			errText = orDash(r.ErrorClass)
			if r.ErrorMessage != nil {
				errText += ": " + *r.ErrorMessage
			}
		}
		why := orDash(r.Reason)
		if r.Event == "published" && r.Partition != nil && r.RecordOffset != nil {
			why = fmt.Sprintf("partition %d offset %d", *r.Partition, *r.RecordOffset)
		}
		by := "-" // the service itself
		if r.Actor != nil {
			by = *r.Actor
		}
		t.row("  "+formatTime(r.RecordedAt), strconv.FormatInt(r.MessageID, 10), r.Event, strconv.Itoa(int(r.Attempt)),
			printable(orDash(r.TargetTopic), false), formatTimePtr(r.NextRunAt), printable(why, false),
			printable(errText, false), printable(by, false))
	}
	t.flush()
}

func truncatedNote(truncated bool) string {
	if truncated {
		return fmt.Sprintf(", first %d bytes; --full for all", previewBytes)
	}
	return ""
}

const expediteHelp = `Usage: scheduler expedite ID... | --id ID[,ID...] | --key KEY | --target GLOB [--json]

Makes pending messages due now and prints them. Per-key order still holds: a
message goes out once it heads its business key, and a key that backs off
after failed publishes keeps its back-off. Give exactly one of:

  ID..., --id  the given messages, as arguments or --id, each one id or ids
               separated by commas (runbook expedite_id.sql). If any of them
               does not exist or is not pending, nothing changes.
  --key        the waiting messages of one business key, exact
               (expedite_key.sql)
  --target     the waiting messages for the target topics matching this glob
               (* any run of characters, ? one; a plain name is exact): for
               each such topic with pending messages, expedite_target.sql

The history records each message made due earlier as 'expedited', with who
(cli: and your user name).

A key or target without pending messages is an error; one whose pending
messages are all due already has nothing to expedite, which is not. A key
held by a parked message stays held ("scheduler held"): replay or cancel the
parked message to let the rest go.
`

// cmdExpedite implements `scheduler expedite`.
func cmdExpedite(ctx context.Context, args, environ []string, stdout, stderr io.Writer) int {
	o, fs := newOps("expedite", args, stdout, stderr)
	var flagIDs []int64
	fs.Var(idsValue{&flagIDs}, "id", "expedite these pending messages: an id, or ids separated by commas; repeatable (or give them as arguments)")
	key := fs.String("key", "", "expedite the waiting messages of this business key (exact)")
	target := fs.String("target", "", "expedite the waiting messages for the target topics matching this glob (* any run, ? one character)")
	pos, done, code := o.parse(fs, args, expediteHelp)
	if done {
		return code
	}
	var given []string
	fs.Visit(func(f *flag.Flag) {
		if f.Name != "json" && f.Name != "id" {
			given = append(given, "--"+f.Name)
		}
	})
	ids, err := idArgs(pos, flagIDs)
	if err != nil {
		return o.exit(err)
	}
	if len(ids) > 0 {
		given = append(given, "--id")
	}
	if len(given) != 1 {
		return o.exit(usagef("give exactly one of ids (arguments or --id), --key and --target (got %d)", len(given)))
	}
	switch given[0] {
	case "--key":
		if *key == "" {
			return o.exit(usagef("--key is empty"))
		}
	case "--target":
		if *target == "" {
			return o.exit(usagef("--target is empty"))
		}
		if _, err := targetFilter(*target); err != nil {
			return o.exit(err)
		}
	}
	var changed []operate.Message
	var note string
	err = o.change(ctx, environ, func(tx pgx.Tx) (err error) {
		switch given[0] {
		case "--id":
			changed, err = changeIDs(ctx, tx, "expedite_id.sql", ids, nil, "only pending messages can be expedited (replay a parked one)")
		case "--key":
			changed, note, err = expediteAll(ctx, tx, "expedite_key.sql", "key", []string{*key}, *key, "business key")
		case "--target":
			var targets []string
			if targets, err = pendingTargets(ctx, tx, *target); err == nil {
				changed, note, err = expediteAll(ctx, tx, "expedite_target.sql", "target", targets, *target, "target topic")
			}
		}
		return err
	})
	if err != nil {
		return o.exit(err)
	}
	return o.exit(o.printChanged("expedited", changed, note))
}

// expediteAll runs expedite_key.sql or expedite_target.sql once for each of
// values (the key, or the target topics a --target glob matched). When it
// changes nothing, it tells a key or target with no pending message (likely
// a typo: an error) from one whose pending messages are all due already (a
// note). given is what the operator typed, for messages.
func expediteAll(ctx context.Context, q operate.Queryer, file, variable string, values []string, given, what string) ([]operate.Message, string, error) {
	var changed []operate.Message
	for _, v := range values {
		rows, err := operate.Rows[operate.Message](ctx, q, file, map[string]string{variable: v})
		if err != nil {
			return nil, "", err
		}
		changed = append(changed, rows...)
	}
	if len(changed) > 0 {
		return sortByID(changed), "", nil
	}
	if len(values) == 0 {
		return nil, "", fmt.Errorf("no pending message with %s %q", what, given)
	}
	filter := map[string]string{"target": "", "state": "pending", "key": "", "reason": "", "limit": "1"}
	if variable == "target" {
		filter["target"] = "" // values come from the pending targets: they have some
	} else {
		filter[variable] = values[0]
	}
	pending, err := operate.Rows[operate.Message](ctx, q, "list.sql", filter)
	if err != nil {
		return nil, "", err
	}
	if len(pending) == 0 || (variable == "key" && deref(pending[0].BusinessKey) != values[0]) {
		return nil, "", fmt.Errorf("no pending message with %s %q", what, given)
	}
	return changed, fmt.Sprintf("nothing to expedite: the pending messages with %s %q are all due already", what, given), nil
}

// pendingTargets returns the target topics with pending messages that
// match the glob, from backlog.sql.
func pendingTargets(ctx context.Context, q operate.Queryer, glob string) ([]string, error) {
	backlog, err := operate.Rows[operate.BacklogRow](ctx, q, "backlog.sql", nil)
	if err != nil {
		return nil, err
	}
	var targets []string
	for _, b := range backlog {
		if b.State != "pending" || b.TargetTopic == nil {
			continue
		}
		if ok, _ := path.Match(glob, *b.TargetTopic); ok {
			targets = append(targets, *b.TargetTopic)
		}
	}
	return targets, nil
}

const cancelHelp = `Usage: scheduler cancel [--json] ID...
       scheduler cancel --id ID[,ID...]

Deletes the given messages for good, whatever their state, and prints them.
Ids are arguments or --id, each one id or ids separated by commas. If any of
them does not exist, nothing is deleted. There is no undo: the history keeps
a 'cancelled' event with who (cli: and your user name). It runs the runbook
file cancel_id.sql.
`

// cmdCancel implements `scheduler cancel`.
func cmdCancel(ctx context.Context, args, environ []string, stdout, stderr io.Writer) int {
	o, fs := newOps("cancel", args, stdout, stderr)
	var flagIDs []int64
	fs.Var(idsValue{&flagIDs}, "id", "cancel these messages: an id, or ids separated by commas; repeatable (or give them as arguments)")
	pos, done, code := o.parse(fs, args, cancelHelp)
	if done {
		return code
	}
	ids, err := idArgs(pos, flagIDs)
	if err != nil {
		return o.exit(err)
	}
	if len(ids) == 0 {
		return o.exit(usagef("want at least one message id"))
	}
	var changed []operate.Message
	err = o.change(ctx, environ, func(tx pgx.Tx) (err error) {
		changed, err = changeIDs(ctx, tx, "cancel_id.sql", ids, nil, "")
		return err
	})
	if err != nil {
		return o.exit(err)
	}
	return o.exit(o.printChanged("cancelled", changed, ""))
}

const parkHelp = `Usage: scheduler park --why TEXT [--release-key] [--json] ID...
       scheduler park --why TEXT --id ID[,ID...]

Parks the given pending messages: state 'parked' with the reason
"operator: TEXT" (reason code operator), and prints them. A parked message
is never sent. Whether it holds its business key follows its target's retry
policy (the default holds): the later messages of the key wait behind it until it is
replayed or cancelled. --release-key lets the rest of the key go on without
it. Ids are arguments or --id, each one id or ids separated by commas. If any
of them does not exist or is not pending, nothing changes. (--reason is a
reason code in every command that filters; here it is refused, pointing to
--why.) The history records the park with who (cli: and your user name). It
runs the runbook file park_id.sql; "scheduler replay ID" sends a parked
message again.
`

// cmdPark implements `scheduler park`.
func cmdPark(ctx context.Context, args, environ []string, stdout, stderr io.Writer) int {
	o, fs := newOps("park", args, stdout, stderr)
	why := fs.String("why", "", `why, recorded as the reason "operator: TEXT" (required)`)
	oldWhy := fs.String("reason", "", "not here: --reason is a reason code in ls and replay; park takes --why TEXT")
	release := fs.Bool("release-key", false, "let the later messages of the key go on without the parked one")
	var flagIDs []int64
	fs.Var(idsValue{&flagIDs}, "id", "park these messages: an id, or ids separated by commas; repeatable (or give them as arguments)")
	pos, done, code := o.parse(fs, args, parkHelp)
	if done {
		return code
	}
	ids, err := idArgs(pos, flagIDs)
	if err != nil {
		return o.exit(err)
	}
	if len(ids) == 0 {
		return o.exit(usagef("want at least one message id"))
	}
	if *oldWhy != "" {
		return o.exit(usagef("--reason is a reason code (ls, replay); say why with --why %s", quoteIfNeeded(*oldWhy)))
	}
	if strings.TrimSpace(*why) == "" {
		return o.exit(usagef("--why is required: say why, for whoever replays it"))
	}
	var changed []operate.Message
	err = o.change(ctx, environ, func(tx pgx.Tx) (err error) {
		vars := map[string]string{"why": *why, "release": strconv.FormatBool(*release)}
		changed, err = changeIDs(ctx, tx, "park_id.sql", ids, vars, "only pending messages can be parked")
		return err
	})
	if err != nil {
		return o.exit(err)
	}
	return o.exit(o.printChanged("parked", changed, ""))
}

// printChanged prints what a changing command did: the messages as they are
// now (as they were, for a cancel), then a count, or with --json
// {"<verb>": n, "messages": [...]} and a note if there is one.
func (o *ops) printChanged(verb string, changed []operate.Message, note string) error {
	if changed == nil {
		changed = []operate.Message{}
	}
	if o.json {
		out := map[string]any{verb: len(changed), "messages": changed}
		if note != "" {
			out["note"] = note
		}
		return o.printJSON(out)
	}
	if len(changed) > 0 {
		printMessages(o.stdout, changed)
	}
	if note != "" {
		fmt.Fprintln(o.stdout, note)
		return nil
	}
	_, err := fmt.Fprintf(o.stdout, "%s %d message%s\n", verb, len(changed), plural(len(changed), "", "s"))
	return err
}

// changeIDs runs the runbook file name with vars and :'ids' set to ids, in
// the caller's transaction (o.change), and fails, so that the transaction
// rolls back, unless every id was changed: it says, for each id left out,
// whether it does not exist or which state it is in, followed by
// onlyPending when some exist.
func changeIDs(ctx context.Context, tx pgx.Tx, name string, ids []int64, vars map[string]string, onlyPending string) ([]operate.Message, error) {
	vars = maps.Clone(vars)
	if vars == nil {
		vars = map[string]string{}
	}
	vars["ids"] = idList(ids)
	changed, err := operate.Rows[operate.Message](ctx, tx, name, vars)
	if err != nil {
		return nil, err
	}
	var missing []int64
	for _, id := range ids {
		if !slices.ContainsFunc(changed, func(m operate.Message) bool { return m.ID == id }) {
			missing = append(missing, id)
		}
	}
	if len(missing) > 0 {
		return nil, explainMissing(ctx, tx, missing, onlyPending)
	}
	return sortByID(changed), nil
}

// sortByID orders what a statement's RETURNING gave, which comes in no
// particular order.
func sortByID(ms []operate.Message) []operate.Message {
	slices.SortFunc(ms, func(a, b operate.Message) int { return cmp.Compare(a.ID, b.ID) })
	return ms
}

// idStatesQuery finds what became of ids a runbook statement did not touch,
// to say why. It is not an operator task of its own, so it is not in the
// runbook.
const idStatesQuery = `SELECT id, state FROM deferred_message WHERE id = ANY ($1::bigint[])`

func explainMissing(ctx context.Context, q operate.Queryer, missing []int64, onlyPending string) error {
	rows, err := q.Query(ctx, idStatesQuery, missing)
	if err != nil {
		return fmt.Errorf("look up ids: %w", err)
	}
	states := map[int64]string{}
	var id int64
	var state string
	if _, err := pgx.ForEachRow(rows, []any{&id, &state}, func() error {
		states[id] = state
		return nil
	}); err != nil {
		return fmt.Errorf("look up ids: %w", err)
	}
	var why []string
	for _, id := range missing {
		if s, ok := states[id]; ok {
			why = append(why, fmt.Sprintf("message %d is %s", id, s))
		} else {
			why = append(why, fmt.Sprintf("no message with id %d", id))
		}
	}
	msg := strings.Join(why, ", ")
	if len(states) > 0 && onlyPending != "" {
		msg += ": " + onlyPending
	}
	return fmt.Errorf("%s; nothing changed", msg)
}
