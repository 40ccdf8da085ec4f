"""plain_agent with the current time in its system prompt: deliberately not
deterministic (every request differs from the recorded one), so a replay of
its run must end Diverged."""

from datetime import datetime, timezone

import plain_agent

if __name__ == "__main__":
    now = datetime.now(timezone.utc).isoformat()
    plain_agent.main(system=f"{plain_agent.SYSTEM} The time is {now}.", name="clock-agent")
