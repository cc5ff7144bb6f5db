package opscli

// Who acts, for the history, and what TARGET_TOPICS allows, for warnings.

import (
	"context"
	"encoding/json"
	"fmt"
	"os/user"
	"slices"
	"strings"

	"github.com/jackc/pgx/v5"

	"github.com/deferq/scheduler/internal/cmdflag"
	"github.com/deferq/scheduler/internal/defer/protocol"
	"github.com/deferq/scheduler/internal/operate"
)

// actorName names who runs a changing command in the history
// (deferred_attempt.actor, target_control_history.actor): "cli:" and the
// operating system user, from $USER, else the process's user.
func actorName(environ []string) string {
	name := cmdflag.Lookup(environ, "USER")
	if name == "" {
		if u, err := user.Current(); err == nil {
			name = u.Username
		}
	}
	if name == "" {
		name = "unknown"
	}
	return "cli:" + name
}

// change connects and runs f in one transaction that names the actor
// (operate.SetActor) and commits only if f succeeds.
func (o *ops) change(ctx context.Context, environ []string, f func(tx pgx.Tx) error) error {
	return o.withConn(ctx, environ, func(conn *pgx.Conn) error {
		return o.inTx(ctx, conn, readCommitted(), func(tx pgx.Tx) error {
			if err := operate.SetActor(ctx, tx, actorName(environ)); err != nil {
				return err
			}
			return f(tx)
		})
	})
}

// targetCheck tells the target topics TARGET_TOPICS (as the service reads
// it, from this command's environment) does not allow: dispatch parks their
// messages again (target_not_allowed) however often they are replayed.
type targetCheck struct {
	patterns protocol.TargetPatterns
	// why is set when no check can be made: TARGET_TOPICS unset or invalid.
	why string
}

func readTargetCheck(environ []string) targetCheck {
	v, ok := lookupEnv(environ, "TARGET_TOPICS")
	if !ok {
		return targetCheck{why: "TARGET_TOPICS is not set in this environment, so whether the targets are allowed could not be checked (set it as the service has it)"}
	}
	p, err := protocol.ParseTargetPatterns(v)
	if err != nil {
		return targetCheck{why: fmt.Sprintf("TARGET_TOPICS is not valid here (%v), so whether the targets are allowed could not be checked", err)}
	}
	return targetCheck{patterns: p}
}

// lookupEnv is os.LookupEnv over environ: the last setting wins.
func lookupEnv(environ []string, name string) (string, bool) {
	value, found := "", false
	for _, e := range environ {
		if k, v, ok := strings.Cut(e, "="); ok && k == name {
			value, found = v, true
		}
	}
	return value, found
}

// warning returns what to say about targets, or "" when TARGET_TOPICS
// allows them all. what names the action, e.g. "replayed".
func (c targetCheck) warning(targets []string, what string) string {
	if c.why != "" {
		return c.why
	}
	var refused []string
	for _, t := range targets {
		if t != "" && !c.patterns.Allows(t) && !slices.Contains(refused, t) {
			refused = append(refused, t)
		}
	}
	if len(refused) == 0 {
		return ""
	}
	slices.Sort(refused)
	return fmt.Sprintf("TARGET_TOPICS (%s) does not allow %s: dispatch parks %s messages again at once (target_not_allowed); allow %s in TARGET_TOPICS and restart the service first",
		strings.Join(c.patterns, ","), strings.Join(refused, ", "), what, plural(len(refused), "it", "them"))
}

// outside returns the warning for targets TARGET_TOPICS does not allow, or
// "" when it allows them or cannot be checked.
func (c targetCheck) outside(targets []string, what string) string {
	if c.why != "" {
		return ""
	}
	return c.warning(targets, what)
}

// warn prints a warning on stderr (as {"warning": "..."} with --json).
func (o *ops) warn(msg string) {
	if msg == "" {
		return
	}
	if o.json {
		b, _ := json.Marshal(map[string]string{"warning": msg}) // a map of strings always marshals
		fmt.Fprintf(o.stderr, "%s\n", b)
		return
	}
	fmt.Fprintf(o.stderr, "scheduler %s: warning: %s\n", o.name, oneLine(msg))
}
