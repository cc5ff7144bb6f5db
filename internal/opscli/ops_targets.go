package opscli

// The per-target controls: pause, resume, limit, weight and targets, over
// the target_control rows of the runbook files pause_target.sql,
// resume_target.sql, limit_target.sql, unlimit_target.sql,
// weight_target.sql and targets.sql.

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"math"
	"strconv"
	"strings"

	"github.com/jackc/pgx/v5"

	"github.com/deferq/scheduler/internal/defer/protocol"
	"github.com/deferq/scheduler/internal/operate"
)

// targetChange is what pause, resume, limit and weight print with --json.
type targetChange struct {
	// Changed is false when the target already was as asked (resume of a
	// target that is not paused, limit off of one without a limit, a
	// weight it has).
	Changed bool              `json:"changed"`
	Target  operate.TargetRow `json:"target"`
	Note    string            `json:"note,omitempty"`
}

// parseTarget checks the TARGET argument of the target commands: one legal
// Kafka topic name.
func parseTarget(pos []string, want int, what string) (string, error) {
	if len(pos) == 0 {
		return "", usagef("want a target topic%s", what)
	}
	if len(pos) > want {
		return "", usagef("unexpected argument %q", pos[want])
	}
	if len(pos) < want {
		return "", usagef("want a target topic%s, got only %q", what, pos[0])
	}
	if !protocol.ValidTopic(pos[0]) {
		return "", usagef("%q is not a Kafka topic name: want 1 to 249 characters of a-z A-Z 0-9 . _ -", pos[0])
	}
	return pos[0], nil
}

// parseRate parses a rate in messages per second: a finite number > 0.
func parseRate(flagName, s string) (float64, error) {
	r, err := strconv.ParseFloat(strings.TrimSpace(s), 64)
	if err != nil || math.IsNaN(r) || math.IsInf(r, 0) {
		return 0, usagef("%s %q is not a number: want messages per second, e.g. 50 or 0.5", flagName, s)
	}
	if r <= 0 {
		return 0, usagef("%s %s: want messages per second > 0", flagName, s)
	}
	return r, nil
}

// formatRate prints a rate as the operator typed it, without float noise.
func formatRate(r float64) string { return strconv.FormatFloat(r, 'g', -1, 64) }

const pauseHelp = `Usage: scheduler pause TARGET [--note TEXT] [--json]

Stops republishing to the target topic TARGET: its messages stay pending, in
per-key order, and keep arriving, while every other target flows. Dispatchers
see it within a poll interval; a publish in progress finishes. A paused
target's messages are not counted as late. The note says why, for whoever
resumes it (pausing again with a note replaces it; without one keeps it).
TARGET is one topic name, exact. A target that TARGET_TOPICS (read from this
environment, as the service reads it) does not allow gets a warning: its
messages are parked by dispatch anyway. The change is recorded with who
(cli: and your user name; "scheduler targets" shows it). It runs the runbook
file pause_target.sql; "scheduler resume TARGET" undoes it.
`

// cmdPause implements `scheduler pause`.
func cmdPause(ctx context.Context, args, environ []string, stdout, stderr io.Writer) int {
	o, fs := newOps("pause", args, stdout, stderr)
	note := fs.String("note", "", "why, e.g. an incident number")
	pos, done, code := o.parse(fs, args, pauseHelp)
	if done {
		return code
	}
	target, err := parseTarget(pos, 1, "")
	if err != nil {
		return o.exit(err)
	}
	o.warn(readTargetCheck(environ).outside([]string{target}, "its"))
	var rows []operate.TargetRow
	err = o.change(ctx, environ, func(tx pgx.Tx) (err error) {
		rows, err = operate.Rows[operate.TargetRow](ctx, tx, "pause_target.sql", map[string]string{"target": target, "note": *note})
		return err
	})
	if err == nil && len(rows) != 1 {
		err = fmt.Errorf("runbook pause_target.sql: %d rows, want 1", len(rows))
	}
	if err != nil {
		return o.exit(err)
	}
	return o.exit(o.printTargetChange("paused", targetChange{Changed: true, Target: rows[0]}))
}

const resumeHelp = `Usage: scheduler resume TARGET [--json]

Republishes to the paused target topic TARGET again: its due messages go out
at once, in per-key order (paced by its rate limit, if it has one), the rest
when due. Resuming a target that is not paused changes nothing; one that has
no controls at all (never paused or limited: a typo?) is an error. It runs the
runbook file resume_target.sql.
`

// cmdResume implements `scheduler resume`.
func cmdResume(ctx context.Context, args, environ []string, stdout, stderr io.Writer) int {
	o, fs := newOps("resume", args, stdout, stderr)
	pos, done, code := o.parse(fs, args, resumeHelp)
	if done {
		return code
	}
	target, err := parseTarget(pos, 1, "")
	if err != nil {
		return o.exit(err)
	}
	var c targetChange
	err = o.change(ctx, environ, func(tx pgx.Tx) (err error) {
		c, err = changeTarget(ctx, tx, "resume_target.sql", target, nil, "not paused")
		return err
	})
	if err != nil {
		return o.exit(err)
	}
	return o.exit(o.printTargetChange("resumed", c))
}

const limitHelp = `Usage: scheduler limit TARGET RATE [--json]
       scheduler limit TARGET --rate RATE [--json]
       scheduler limit TARGET off [--json]

Caps republishing to the target topic TARGET at RATE messages per second (a
number > 0; 0.5 is one message every two seconds), across every replica:
dispatchers share one token bucket per target, with at most one second's
worth of burst. Its messages wait, pending and in per-key order, for their
turn; other targets are not affected. "off" (or --rate off) lifts the
limit. RATE is an argument or --rate, as in replay. The change is recorded
with who (cli: and your user name). It runs the runbook file
limit_target.sql, or unlimit_target.sql for off.
`

// cmdLimit implements `scheduler limit`.
func cmdLimit(ctx context.Context, args, environ []string, stdout, stderr io.Writer) int {
	o, fs := newOps("limit", args, stdout, stderr)
	// A negative rate would read as an unknown flag; say what is wrong with
	// it instead.
	for _, a := range args {
		if a == "--" {
			break
		}
		if r, err := strconv.ParseFloat(a, 64); err == nil && r < 0 {
			return o.exit(usagef("rate %s: want messages per second > 0", a))
		}
	}
	rateFlag := fs.String("rate", "", "messages per second (> 0), or off; or give it as the second argument")
	pos, done, code := o.parse(fs, args, limitHelp)
	if done {
		return code
	}
	rateGiven := false
	fs.Visit(func(f *flag.Flag) { rateGiven = rateGiven || f.Name == "rate" })
	if rateGiven {
		if len(pos) > 1 {
			return o.exit(usagef("give the rate once: as an argument (%s) or --rate (%s)", pos[1], *rateFlag))
		}
		pos = append(pos, *rateFlag)
	}
	target, err := parseTarget(pos, 2, " and a rate (messages per second, or off)")
	if err != nil {
		return o.exit(err)
	}
	off := strings.EqualFold(pos[1], "off")
	var rate float64
	if !off {
		if rate, err = parseRate("rate", pos[1]); err != nil {
			return o.exit(err)
		}
	}
	var c targetChange
	err = o.change(ctx, environ, func(tx pgx.Tx) (err error) {
		if off {
			c, err = changeTarget(ctx, tx, "unlimit_target.sql", target, nil, "not rate limited")
			return err
		}
		c, err = changeTarget(ctx, tx, "limit_target.sql", target, map[string]string{"rate": formatRate(rate)}, "")
		return err
	})
	if err != nil {
		return o.exit(err)
	}
	verb := "limited"
	if off {
		verb = "unlimited"
	}
	return o.exit(o.printTargetChange(verb, c))
}

const weightHelp = `Usage: scheduler weight TARGET WEIGHT [--json]

Sets how many of the target topic TARGET's due messages (of as many keys)
each turn of a dispatch claim takes while other targets have due messages
too: a whole number from 1 to 100, 1 by default. Claims share their rounds
between the targets with due messages turn by turn, so with weights 3 and 1
two backlogs drain at 3 to 1. A target alone still gets every round, and
one that runs out of due messages leaves the rest to the others: a weight
holds nothing back (limit does). Per-key order is untouched. Dispatchers
use it from their next claim. WEIGHT 1 undoes it. The change is recorded
with who (cli: and your user name). It runs the runbook file
weight_target.sql.
`

// cmdWeight implements `scheduler weight`.
func cmdWeight(ctx context.Context, args, environ []string, stdout, stderr io.Writer) int {
	o, fs := newOps("weight", args, stdout, stderr)
	// A negative weight would read as an unknown flag; say what is wrong
	// with it instead.
	for _, a := range args {
		if a == "--" {
			break
		}
		if w, err := strconv.Atoi(a); err == nil && w < 0 {
			return o.exit(usagef("weight %s: want a whole number from 1 to %d", a, operate.MaxTargetWeight))
		}
	}
	pos, done, code := o.parse(fs, args, weightHelp)
	if done {
		return code
	}
	target, err := parseTarget(pos, 2, fmt.Sprintf(" and a weight (1 to %d)", operate.MaxTargetWeight))
	if err != nil {
		return o.exit(err)
	}
	weight, err := strconv.Atoi(strings.TrimSpace(pos[1]))
	if err != nil || weight < 1 || weight > operate.MaxTargetWeight {
		return o.exit(usagef("weight %q: want a whole number from 1 to %d (1 is the default)", pos[1], operate.MaxTargetWeight))
	}
	var c targetChange
	err = o.change(ctx, environ, func(tx pgx.Tx) (err error) {
		c, err = changeTarget(ctx, tx, "weight_target.sql", target, map[string]string{"weight": strconv.Itoa(weight)},
			fmt.Sprintf("of weight %d already", weight))
		if errors.Is(err, errNoControls) && weight == 1 {
			// No row is weight 1, the default: as asked.
			c = targetChange{Target: operate.TargetRow{TargetTopic: target, Weight: 1},
				Note: fmt.Sprintf("target %s has no controls, so weight 1 already (the default); nothing changed", target)}
			return nil
		}
		return err
	})
	if err != nil {
		return o.exit(err)
	}
	return o.exit(o.printTargetChange("weighted", c))
}

// errNoControls is changeTarget's error for a target without a row in
// target_control.
var errNoControls = errors.New("no controls")

// changeTarget runs a target runbook file that prints the row it changed.
// When it changes nothing, the target either has no controls at all (an
// error: likely a typo) or was already as asked (a note: asIs says how).
func changeTarget(ctx context.Context, conn operate.Queryer, file, target string, vars map[string]string, asIs string) (targetChange, error) {
	all := map[string]string{"target": target}
	for k, v := range vars {
		all[k] = v
	}
	rows, err := operate.Rows[operate.TargetRow](ctx, conn, file, all)
	if err != nil {
		return targetChange{}, err
	}
	if len(rows) == 1 {
		return targetChange{Changed: true, Target: rows[0]}, nil
	}
	if len(rows) > 1 {
		return targetChange{}, fmt.Errorf("runbook %s: %d rows, want at most 1", file, len(rows))
	}
	targets, err := operate.Rows[operate.TargetRow](ctx, conn, "targets.sql", nil)
	if err != nil {
		return targetChange{}, err
	}
	for _, t := range targets {
		if t.TargetTopic == target {
			return targetChange{Target: t, Note: fmt.Sprintf("target %s is %s; nothing changed", target, asIs)}, nil
		}
	}
	return targetChange{}, fmt.Errorf("target %s has %w (it was never paused, limited or weighted); nothing changed: scheduler targets lists them", target, errNoControls)
}

// printTargetChange prints what pause, resume, limit or weight did: the target's
// row, then what happened.
func (o *ops) printTargetChange(verb string, c targetChange) error {
	if o.json {
		return o.printJSON(c)
	}
	printTargets(o.stdout, []operate.TargetRow{c.Target})
	if c.Note != "" {
		_, err := fmt.Fprintln(o.stdout, c.Note)
		return err
	}
	_, err := fmt.Fprintf(o.stdout, "%s %s\n", verb, c.Target.TargetTopic)
	return err
}

func printTargets(w io.Writer, rows []operate.TargetRow) {
	t := newTable(w, "TARGET", "PAUSED", "RATE LIMIT", "WEIGHT", "UPDATED AT", "CHANGED BY", "NOTE")
	for _, r := range rows {
		paused, limit := "no", "-"
		if r.Paused {
			paused = "yes"
		}
		if r.RateLimit != nil {
			limit = formatRate(*r.RateLimit) + "/s"
		}
		t.row(printable(r.TargetTopic, false), paused, limit, strconv.Itoa(r.Weight), formatTime(r.UpdatedAt), printable(orDash(r.ChangedBy), false),
			printable(orDash(r.Note), false))
	}
	t.flush()
}

const targetsHelp = `Usage: scheduler targets [--json]

Lists the per-target controls (table target_control): for each target topic
that is paused, limited, weighted or has a note, whether it is paused and
why, its rate limit in messages per second, its weight in dispatch claims'
turns (1: the default), when it last changed and who changed it
(cli:USER, console:USER, or the database user of a psql session; the whole
record is in table target_control_history). Targets not listed flow freely.
It runs the runbook file targets.sql.
`

// cmdTargets implements `scheduler targets`.
func cmdTargets(ctx context.Context, args, environ []string, stdout, stderr io.Writer) int {
	o, fs := newOps("targets", args, stdout, stderr)
	pos, done, code := o.parse(fs, args, targetsHelp)
	if done {
		return code
	}
	if len(pos) > 0 {
		return o.exit(usagef("unexpected argument %q", pos[0]))
	}
	_, code, _ = showRunbook(ctx, o, environ, "targets.sql", nil, "no target is paused, limited or weighted", printTargets)
	return code
}
