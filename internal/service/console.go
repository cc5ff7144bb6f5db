package service

import (
	"context"

	"github.com/deferq/scheduler/internal/console"
)

// startConsole serves the operator console on CONSOLE_ADDR, with a pool of
// its own on CONSOLE_DATABASE_URL (else DATABASE_URL): apart from
// HTTP_ADDR, so that people can reach it while /metrics stays internal.
func (s *Service) startConsole(ctx context.Context) error {
	// The key-state server's view of Kafka is set once the scheduler has
	// connected; the console is served before, while Kafka may be down.
	srv, err := console.Start(ctx, &s.cfg, s.cfg.ConsoleAddr, s.keyStates.HighWaterMarks, s.logger.With("component", "console"))
	if err != nil {
		return err
	}
	s.console = srv
	return nil
}
