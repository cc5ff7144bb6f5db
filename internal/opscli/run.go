package opscli

import (
	"context"
	"io"
)

// Commands returns the operator commands Run knows, in the order the usage
// text gives them.
func Commands() []string {
	return []string{"status", "ls", "show", "held", "expedite", "cancel", "park", "replay", "pause", "resume", "limit", "weight", "targets",
		"inflight", "release"}
}

// Run runs the operator command name with its arguments against the
// database of DATABASE_URL in environ, and returns its exit code: 0 on
// success, 1 when the command failed, 2 for a usage error. ok is false when
// name is not an operator command. stdin answers the questions a command
// asks (replay's confirmation).
func Run(ctx context.Context, name string, args, environ []string, stdin io.Reader, stdout, stderr io.Writer) (code int, ok bool) {
	switch name {
	case "status":
		return cmdStatus(ctx, args, environ, stdout, stderr), true
	case "ls":
		return cmdLs(ctx, args, environ, stdout, stderr), true
	case "show":
		return cmdShow(ctx, args, environ, stdout, stderr), true
	case "held":
		return cmdHeld(ctx, args, environ, stdout, stderr), true
	case "expedite":
		return cmdExpedite(ctx, args, environ, stdout, stderr), true
	case "cancel":
		return cmdCancel(ctx, args, environ, stdout, stderr), true
	case "park":
		return cmdPark(ctx, args, environ, stdout, stderr), true
	case "replay":
		return cmdReplay(ctx, args, environ, stdin, stdout, stderr), true
	case "pause":
		return cmdPause(ctx, args, environ, stdout, stderr), true
	case "resume":
		return cmdResume(ctx, args, environ, stdout, stderr), true
	case "limit":
		return cmdLimit(ctx, args, environ, stdout, stderr), true
	case "weight":
		return cmdWeight(ctx, args, environ, stdout, stderr), true
	case "targets":
		return cmdTargets(ctx, args, environ, stdout, stderr), true
	case "inflight":
		return cmdInflight(ctx, args, environ, stdout, stderr), true
	case "release":
		return cmdRelease(ctx, args, environ, stdout, stderr), true
	}
	return 0, false
}
