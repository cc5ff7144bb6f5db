package opscli

// scheduler replay: parked or rejected messages back to pending, chosen by
// filters, previewed first (replay_preview.sql), then moved in one statement
// (replay.sql) that checks the filters again.

import (
	"bufio"
	"cmp"
	"context"
	"flag"
	"fmt"
	"io"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/deferq/scheduler/internal/operate"
	"github.com/deferq/scheduler/internal/reason"
	"github.com/jackc/pgx/v5"
)

// replayShown is how many matching messages replay prints before it acts:
// enough to recognise them, little enough for one screen.
const replayShown = 20

const replayHelp = `Usage: scheduler replay [ID...] FILTER... [--dry-run] [--rate N] [--reset-attempts]
                        [--yes] [--confirm-above N] [--json]

Sends parked messages (or, with --state rejected, rejected ones) again: back
to pending, reason cleared, redrive count + 1 (republished as
defer.redrive-count). Each goes back to its place in its business key; a
parked message that held its key goes first and the rest of the key follows.

Filters combine (all must match), and at least one is required, so that
"replay everything" is never an accident (--target '*' says it on purpose):
  --target GLOB       target topic, * any run of characters, ? one, \ escapes;
                      a plain name is exact
  --key KEY           business key, exact
  --error-class GLOB  the error class the producer gave
  --reason CODE       reason code, exact: the part of the reason before the
                      first colon (the list is below)
  --since, --until    parked (rejected: last changed) at or after / before:
                      an RFC 3339 time, or a duration meaning that long ago
                      (90m, 48h)
  ID..., --id ID      message ids, as arguments or --id, each one id or ids
                      separated by commas; --id is repeatable

It first prints what matches: counts by target and reason, and the first 20
messages, and warns when TARGET_TOPICS (read from this environment, as the
service reads it) does not allow a matched message's target: dispatch would
park it again at once. --dry-run stops there. Above --confirm-above messages (default
100) it asks you to type their number, unless --yes. A rejected record that
named no target topic cannot be replayed: it is listed and left alone.

Exit code: 0 when the messages were replayed, and for --dry-run whatever it
found (also nothing); 1 when nothing matches or nothing can be replayed
(without --dry-run), when not confirmed, or on a database error; 2 for a
usage error.

--rate N staggers the due times at N messages per second, oldest parked
first: dispatch then sends them at that pace even after this command exits
(the messages waiting behind a held key follow their head unpaced; "scheduler
limit" paces a whole target). --reset-attempts sets attempt to 0, so that the
retry policy starts over.

A message that changed after the preview (replayed, cancelled) is left
alone; the count says how many moved. It runs the runbook files
replay_preview.sql and replay.sql.

The history records each replay with who (cli: and your user name).

Examples:
  scheduler replay --target payments.retry --reason unknown_topic --dry-run
  scheduler replay 1234 1235
  scheduler replay --target 'payments.*' --since 2h --rate 50 --yes
  scheduler replay --key order-42 --reset-attempts
  scheduler replay --state rejected --reason target_not_allowed --id 1234,1235
`

// replayGroup counts matching messages by target and reason code.
type replayGroup struct {
	TargetTopic *string `json:"target_topic"`
	Reason      string  `json:"reason"`
	Messages    int     `json:"messages"`
}

// replayReport is what replay prints with --json.
type replayReport struct {
	State   string `json:"state"`
	DryRun  bool   `json:"dry_run"`
	Matched int    `json:"matched"`
	// Groups and Candidates describe every matching message, replayable or
	// not; NotReplayable lists those that cannot be (no target topic).
	Groups        []replayGroup             `json:"groups"`
	Candidates    []operate.ReplayCandidate `json:"candidates"`
	NotReplayable []int64                   `json:"not_replayable"`
	// Replayed is how many moved; LeftAlone how many replayable ones changed
	// between the preview and the replay and were not touched.
	Replayed  int                       `json:"replayed"`
	LeftAlone int                       `json:"left_alone"`
	Rate      *float64                  `json:"rate"`
	Messages  []operate.ReplayedMessage `json:"messages"`
	// Warning says that TARGET_TOPICS does not allow some matched
	// message's target, or that it could not be checked.
	Warning string `json:"warning,omitempty"`
}

// replayFilter is what replay selects by. Empty fields do not filter.
type replayFilter struct {
	state                      string
	ids                        []int64
	targetLike, errorClassLike string
	key, reason                string
	since, until               *time.Time
	// described is the filters as given, for messages.
	described []string
}

// vars are the psql variables of replay_preview.sql and replay.sql.
func (f replayFilter) vars() map[string]string {
	ts := func(t *time.Time) string {
		if t == nil {
			return ""
		}
		return t.UTC().Format(time.RFC3339Nano)
	}
	return map[string]string{
		"state": f.state, "ids": idList(f.ids), "target": f.targetLike, "key": f.key,
		"error_class": f.errorClassLike, "reason": f.reason, "since": ts(f.since), "until": ts(f.until),
	}
}

// idsValue is a repeatable flag of message ids.
type idsValue struct{ ids *[]int64 }

func (v idsValue) String() string {
	if v.ids == nil {
		return ""
	}
	return idList(*v.ids)
}

func (v idsValue) Set(s string) error {
	ids, err := parseIDs([]string{s})
	if err != nil {
		return err
	}
	for _, id := range ids {
		if !slices.Contains(*v.ids, id) {
			*v.ids = append(*v.ids, id)
		}
	}
	return nil
}

// targetFilter translates a --target glob into the LIKE pattern of the
// runbook's :'target' variable; "" stays "" (no filter).
func targetFilter(glob string) (string, error) {
	if glob == "" {
		return "", nil
	}
	like, err := operate.GlobToLike(glob)
	if err != nil {
		return "", usagef("--target %q: %v", glob, err)
	}
	return like, nil
}

// checkReasonCode checks a --reason value: a reason code, not a whole
// reason. An unknown code is not an error (old rows may carry codes no
// longer produced); it simply matches nothing.
func checkReasonCode(code string) error {
	if strings.ContainsAny(code, ": ") {
		return usagef("--reason %q: want a reason code, the part of the reason before the colon, e.g. %s",
			code, strings.TrimSpace(strings.SplitN(code, ":", 2)[0]))
	}
	return nil
}

// parseWhen parses --since or --until: an RFC 3339 time, or a duration
// meaning that long before now.
func parseWhen(flagName, s string, now time.Time) (time.Time, error) {
	if t, err := time.Parse(time.RFC3339Nano, s); err == nil {
		return t, nil
	}
	d, err := time.ParseDuration(s)
	if err != nil || d < 0 {
		return time.Time{}, usagef("%s %q is neither an RFC 3339 time (2024-05-01T12:00:00Z) nor a duration meaning that long ago (90m, 48h)", flagName, s)
	}
	return now.Add(-d), nil
}

// replayOptions are replay's flags other than the filters.
type replayOptions struct {
	dryRun, resetAttempts, yes bool
	rate                       *float64
	confirmAbove               int
	actor                      string      // who replays, for the history
	targets                    targetCheck // TARGET_TOPICS, for the warning
}

// cmdReplay implements `scheduler replay`.
func cmdReplay(ctx context.Context, args, environ []string, stdin io.Reader, stdout, stderr io.Writer) int {
	o, fs := newOps("replay", args, stdout, stderr)
	// buildReplayFilter reads the filters back from fs, by name.
	fs.String("state", "parked", "replay messages in this state: parked or rejected")
	fs.String("target", "", "only messages whose target topic matches this glob (* any run, ? one character)")
	fs.String("key", "", "only messages of this business key (exact)")
	fs.String("error-class", "", "only messages whose error class matches this glob")
	fs.String("reason", "", "only messages with this reason code (the part of the reason before the colon)")
	fs.String("since", "", "only messages parked at or after this: RFC 3339, or a duration meaning ago (2h)")
	fs.String("until", "", "only messages parked before this: RFC 3339, or a duration meaning ago (30m)")
	var ids []int64
	fs.Var(idsValue{&ids}, "id", "only these messages: an id or ids separated by commas; repeatable")
	var opt replayOptions
	fs.BoolVar(&opt.dryRun, "dry-run", false, "print what matches and change nothing")
	rate := fs.String("rate", "", "stagger due times at this many messages per second (> 0); default: all due now")
	fs.BoolVar(&opt.resetAttempts, "reset-attempts", false, "set attempt to 0, so that the retry policy starts over")
	fs.BoolVar(&opt.yes, "yes", false, "do not ask for confirmation")
	fs.IntVar(&opt.confirmAbove, "confirm-above", 100, "ask to confirm when more than this many messages would move")
	pos, done, code := o.parse(fs, args, replayHelp+reasonCodesHelp())
	if done {
		return code
	}
	ids, err := idArgs(pos, ids)
	if err != nil {
		return o.exit(err)
	}
	f, err := buildReplayFilter(fs, time.Now(), ids)
	if err != nil {
		return o.exit(err)
	}
	rateGiven := false
	fs.Visit(func(fl *flag.Flag) { rateGiven = rateGiven || fl.Name == "rate" })
	if rateGiven {
		r, err := parseRate("--rate", *rate)
		if err != nil {
			return o.exit(err)
		}
		opt.rate = &r
	}
	if opt.confirmAbove < 0 {
		return o.exit(usagef("--confirm-above %d: want 0 or more", opt.confirmAbove))
	}
	opt.actor = actorName(environ)
	opt.targets = readTargetCheck(environ)
	err = o.withConn(ctx, environ, func(conn *pgx.Conn) error {
		return o.replay(ctx, conn, f, opt, stdin)
	})
	return o.exit(err)
}

// buildReplayFilter checks replay's filter flags, parsed into fs, and
// translates them; ids are those of --id.
func buildReplayFilter(fs *flag.FlagSet, now time.Time, ids []int64) (replayFilter, error) {
	state := fs.Lookup("state").Value.String()
	f := replayFilter{state: state, ids: ids}
	if state != "parked" && state != "rejected" {
		return f, usagef("--state %q: replay takes parked or rejected messages", state)
	}
	f.described = append(f.described, "--state "+state)
	var err error
	given := map[string]bool{}
	fs.Visit(func(fl *flag.Flag) { given[fl.Name] = true })
	for _, name := range []string{"target", "key", "error-class", "reason", "since", "until"} {
		if !given[name] {
			continue
		}
		value, suffix := fs.Lookup(name).Value.String(), ""
		if value == "" {
			// An empty filter would select everything: a script's unset
			// variable must not replay the whole parking lot.
			return f, usagef("--%s is empty", name)
		}
		switch name {
		case "key":
			f.key = value
		case "target":
			if f.targetLike, err = operate.GlobToLike(value); err != nil {
				return f, usagef("--target %q: %v", value, err)
			}
		case "error-class":
			if f.errorClassLike, err = operate.GlobToLike(value); err != nil {
				return f, usagef("--error-class %q: %v", value, err)
			}
		case "reason":
			if err := checkReasonCode(value); err != nil {
				return f, err
			}
			f.reason = value
		case "since", "until":
			t, err := parseWhen("--"+name, value, now)
			if err != nil {
				return f, err
			}
			if name == "since" {
				f.since = &t
			} else {
				f.until = &t
			}
			suffix = " (" + formatTime(t) + ")"
		}
		f.described = append(f.described, fmt.Sprintf("--%s %s%s", name, quoteIfNeeded(value), suffix))
	}
	if len(ids) > 0 {
		f.described = append(f.described, "--id "+idList(ids))
	}
	if len(f.described) == 1 {
		return f, usagef("give at least one filter (--target, --key, --error-class, --reason, --since, --until, --id), "+
			"so that replaying every %s message is never an accident; --target '*' means all targets", state)
	}
	if f.since != nil && f.until != nil && !f.since.Before(*f.until) {
		return f, usagef("--since %s is not before --until %s: nothing can match", formatTime(*f.since), formatTime(*f.until))
	}
	return f, nil
}

// quoteIfNeeded quotes a value that holds spaces or is not printable.
func quoteIfNeeded(s string) string {
	if s == printable(s, false) && !strings.ContainsAny(s, " \t\"'") {
		return s
	}
	return strconv.Quote(s)
}

// replay previews, asks if need be, and replays.
func (o *ops) replay(ctx context.Context, conn *pgx.Conn, f replayFilter, opt replayOptions, stdin io.Reader) error {
	var cands []operate.ReplayCandidate
	err := o.inTx(ctx, conn, readCommitted(), func(tx pgx.Tx) (err error) {
		cands, err = operate.Rows[operate.ReplayCandidate](ctx, tx, "replay_preview.sql", f.vars())
		return err
	})
	if err != nil {
		return err
	}
	what := strings.Join(f.described, " ")
	rep := replayReport{
		State: f.state, DryRun: opt.dryRun, Matched: len(cands), Groups: groupCandidates(cands),
		Candidates: cands, NotReplayable: []int64{}, Rate: opt.rate, Messages: []operate.ReplayedMessage{},
	}
	if len(cands) == 0 {
		if !opt.dryRun {
			return fmt.Errorf("no message matches %s; nothing changed", what)
		}
		// A dry run is a question, and "none" is an answer: exit 0.
		if o.json {
			return o.printJSON(rep)
		}
		_, err := fmt.Fprintf(o.stdout, "dry run: no message matches %s; nothing would be replayed\n", what)
		return err
	}
	var replayable []int64
	var targets []string
	for _, c := range cands {
		if c.Replayable {
			replayable = append(replayable, c.ID)
			targets = append(targets, deref(c.TargetTopic))
		} else {
			rep.NotReplayable = append(rep.NotReplayable, c.ID)
		}
	}
	if len(replayable) > 0 {
		rep.Warning = opt.targets.warning(targets, "the replayed")
	}
	if !o.json {
		printCandidates(o.stdout, what, rep)
	}
	if len(replayable) == 0 && opt.dryRun {
		if o.json {
			return o.printJSON(rep)
		}
		_, err := fmt.Fprintf(o.stdout, "dry run: would replay 0 messages: %s; nothing changed\n", notReplayableWhy)
		return err
	}
	if len(replayable) == 0 {
		return fmt.Errorf("none of the %d matching %s message%s can be replayed: %s; nothing changed",
			len(cands), f.state, plural(len(cands), "", "s"), notReplayableWhy)
	}
	if opt.dryRun {
		if o.json {
			return o.printJSON(rep)
		}
		_, err := fmt.Fprintf(o.stdout, "dry run: would replay %d message%s; nothing changed\n", len(replayable), plural(len(replayable), "", "s"))
		return err
	}
	if len(replayable) > opt.confirmAbove && !opt.yes {
		if err := confirmCount(ctx, stdin, o.stderr, len(replayable), f.state); err != nil {
			return err
		}
	}
	vars := f.vars()
	vars["ids"] = idList(replayable)
	vars["rate"] = ""
	if opt.rate != nil {
		vars["rate"] = formatRate(*opt.rate)
	}
	vars["reset_attempts"] = strconv.FormatBool(opt.resetAttempts)
	var moved []operate.ReplayedMessage
	err = o.inTx(ctx, conn, readCommitted(), func(tx pgx.Tx) (err error) {
		if err = operate.SetActor(ctx, tx, opt.actor); err != nil {
			return err
		}
		moved, err = operate.Rows[operate.ReplayedMessage](ctx, tx, "replay.sql", vars)
		return err
	})
	if err != nil {
		return err
	}
	slices.SortFunc(moved, func(a, b operate.ReplayedMessage) int {
		return cmp.Or(a.NextRunAt.Compare(b.NextRunAt), cmp.Compare(a.ID, b.ID))
	})
	rep.Replayed, rep.LeftAlone, rep.Messages = len(moved), len(replayable)-len(moved), moved
	if o.json {
		return o.printJSON(rep)
	}
	return printReplayed(o.stdout, rep)
}

// reasonCodesHelp lists the reason codes (package reason) for --help.
func reasonCodesHelp() string {
	var b strings.Builder
	b.WriteString("\nReason codes (--reason), and who sets them:\n")
	t := newTable(&b)
	for _, i := range reason.All() {
		t.row("  "+i.Code, i.SetBy)
	}
	t.flush()
	return b.String()
}

const notReplayableWhy = "a rejected record that named no target topic has nowhere to go (set its target_topic first)"

// confirmCount asks on stderr for the number of messages about to move and
// reads the answer from stdin. Anything but that number, end of input, or
// an interrupt (the read is abandoned, not waited for) refuses.
func confirmCount(ctx context.Context, stdin io.Reader, stderr io.Writer, n int, state string) error {
	fmt.Fprintf(stderr, "This replays %d %s messages. Type %d to go on: ", n, state, n)
	type answer struct {
		line string
		err  error
	}
	got := make(chan answer, 1)
	go func() {
		line, err := bufio.NewReader(stdin).ReadString('\n')
		got <- answer{line, err}
	}()
	select {
	case <-ctx.Done():
		fmt.Fprintln(stderr)
		return fmt.Errorf("interrupted before confirming; nothing changed")
	case a := <-got:
		typed := strings.TrimSpace(a.line)
		if typed == "" && a.err != nil {
			fmt.Fprintln(stderr)
			return fmt.Errorf("no answer (end of input); nothing changed: --yes replays without asking")
		}
		if typed != strconv.Itoa(n) {
			return fmt.Errorf("not confirmed: typed %q, not %d; nothing changed", printable(typed, false), n)
		}
		return nil
	}
}

// reasonCode is the code of a reason (reason.Code), "-" when there is none.
func reasonCode(r *string) string {
	if r == nil {
		return "-"
	}
	return reason.Code(*r)
}

func groupCandidates(cands []operate.ReplayCandidate) []replayGroup {
	type groupKey struct {
		target *string
		reason string
	}
	same := func(a, b *string) bool { return (a == nil && b == nil) || (a != nil && b != nil && *a == *b) }
	var groups []replayGroup
	for _, c := range cands {
		k := groupKey{c.TargetTopic, reasonCode(c.Reason)}
		i := slices.IndexFunc(groups, func(g replayGroup) bool { return same(g.TargetTopic, k.target) && g.Reason == k.reason })
		if i < 0 {
			groups = append(groups, replayGroup{TargetTopic: k.target, Reason: k.reason})
			i = len(groups) - 1
		}
		groups[i].Messages++
	}
	slices.SortStableFunc(groups, func(a, b replayGroup) int {
		return cmp.Or(cmp.Compare(b.Messages, a.Messages), cmp.Compare(orDash(a.TargetTopic), orDash(b.TargetTopic)), cmp.Compare(a.Reason, b.Reason))
	})
	return groups
}

func printCandidates(w io.Writer, what string, rep replayReport) {
	fmt.Fprintf(w, "%d %s message%s match%s %s:\n", rep.Matched, rep.State, plural(rep.Matched, "", "s"), plural(rep.Matched, "es", ""), printable(what, false))
	t := newTable(w, "  TARGET", "REASON", "MESSAGES")
	for _, g := range rep.Groups {
		t.row("  "+printable(orDash(g.TargetTopic), false), printable(g.Reason, false), strconv.Itoa(g.Messages))
	}
	t.flush()
	when := "PARKED AT"
	if rep.State == "rejected" {
		when = "REJECTED AT"
	}
	if rep.Matched > replayShown {
		fmt.Fprintf(w, "The first %d, oldest first:\n", replayShown)
	}
	t = newTable(w, "  ID", "KEY", "TARGET", when, "REDRIVES", "REASON")
	for _, c := range rep.Candidates[:min(len(rep.Candidates), replayShown)] {
		key := printable(orDash(c.BusinessKey), false)
		if c.HoldsKey {
			key += " (held)"
		}
		t.row("  "+strconv.FormatInt(c.ID, 10), key, printable(orDash(c.TargetTopic), false), formatTime(c.Since),
			strconv.Itoa(int(c.RedriveCount)), printable(orDash(c.Reason), false))
	}
	t.flush()
	if n := len(rep.NotReplayable); n > 0 {
		shown := rep.NotReplayable[:min(n, replayShown)]
		more := ""
		if n > len(shown) {
			more = ", ..."
		}
		fmt.Fprintf(w, "%d cannot be replayed and stay as they are: %s (%s%s)\n", n, notReplayableWhy, idList(shown), more)
	}
	if rep.Warning != "" {
		fmt.Fprintf(w, "Warning: %s\n", rep.Warning)
	}
}

func printReplayed(w io.Writer, rep replayReport) error {
	msg := fmt.Sprintf("replayed %d message%s", rep.Replayed, plural(rep.Replayed, "", "s"))
	switch {
	case rep.Replayed == 0:
	case rep.Rate != nil && rep.Replayed > 1:
		first, last := rep.Messages[0].NextRunAt, rep.Messages[len(rep.Messages)-1].NextRunAt
		msg += fmt.Sprintf(" at %s/s: due from %s to %s (over %s)", formatRate(*rep.Rate), formatTime(first), formatTime(last), humanDuration(last.Sub(first)))
	default:
		msg += ", due now"
	}
	if rep.LeftAlone > 0 {
		msg += fmt.Sprintf("; %d changed since the preview and %s left alone", rep.LeftAlone, plural(rep.LeftAlone, "was", "were"))
	}
	_, err := fmt.Fprintln(w, msg)
	return err
}
